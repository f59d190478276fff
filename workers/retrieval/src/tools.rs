//! The retrieval tools over a [`Store`], each scoped by the call's headers
//! and never by what the model asks. Every search, listing and read is
//! first of all within the invocation's tenant (`Toolfleet-Tenant`, which
//! only the orchestrator writes, from the subject the job was submitted
//! on): the headers below only narrow within it, so a job naming another
//! tenant's data source or document ids finds nothing of theirs.
//!
//! - `document_processing` tools (`search_documents`, `list_documents`,
//!   `read_document`, `read_tabular_data`) see only the chat job's attached
//!   documents (`Toolfleet-Attached-Documents`), and of those only the
//!   ones without an owner user or owned by the job's user
//!   (`Toolfleet-User`, which the orchestrator sets only for a user the
//!   fleet trusts: without one, no owned document is visible).
//! - `search_data_sources` sees only the documents of the job's data
//!   source (`Toolfleet-Data-Source-Id`: the collection of that name).
//! - The context tools (`retrieve_knowledge_context`,
//!   `retrieve_event_context`, `retrieve_profile_context`, `entity_lookup`)
//!   see the job's user's items (`Toolfleet-User`, required), within its
//!   data source when it has one, and may narrow further (device, agent,
//!   time, entities), never widen.
//!
//! Every passage returned is cited: it gets a `[doc:N]` marker from the
//! invocation's shared counter, so the orchestrator can resolve it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use toolfleet_worker::{NewReference, Tool, ToolCtx, ToolError, ToolOutput};

use crate::RetrievalMetrics;
use crate::embed::Embedder;
use crate::model::{Item, ItemKind, Level, Owner, normalize_entity};
use crate::normalize::{Table, column_name, one_line, parse_csv};
use crate::search::{Hit, MAX_TOP_K, Query, TimeRange, merge_keep_best, reciprocal_rank_fusion};
use crate::store::{Store, StoreError};

/// Results per search when the model does not say.
pub const DEFAULT_TOP_K: usize = 5;
/// The most characters of a passage handed to the model.
const PASSAGE_MAX_CHARS: usize = 2400;
/// The longest reference snippet.
const SNIPPET_MAX_CHARS: usize = 300;
/// `read_document`: characters per call by default and at most.
const READ_DEFAULT_CHARS: usize = 6000;
const READ_MAX_CHARS: usize = 20_000;
/// `read_tabular_data`: rows and columns per call by default and at most.
const TABLE_DEFAULT_ROWS: usize = 50;
const TABLE_MAX_ROWS: usize = 200;
const TABLE_DEFAULT_COLUMNS: usize = 20;
const TABLE_MAX_COLUMNS: usize = 50;
/// Event drill-down: a child's score is `PARENT_WEIGHT × parent + (1 −
/// PARENT_WEIGHT) × own`.
pub const PARENT_WEIGHT: f32 = 0.5;
/// Children followed per summary (a summary of thousands is cut).
const MAX_CHILDREN: usize = 100;
/// How similar (Jaro-Winkler on normalised names) a fuzzy entity match
/// must be.
pub const FUZZY_ENTITY_THRESHOLD: f64 = 0.88;
/// Events one drill-down visits at most (summaries and children).
const MAX_EXPANDED: usize = 300;
/// Bucket keys one event search filters on at most, per level.
const MAX_BUCKETS: usize = 400;

/// What every retrieval tool shares: the store and the family's metrics.
#[derive(Clone)]
pub struct Retrieval {
    store: Arc<dyn Store>,
    metrics: Option<RetrievalMetrics>,
    embedder: Option<Embedder>,
}

impl Retrieval {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            metrics: None,
            embedder: None,
        }
    }

    /// Makes every search with words hybrid: BM25 and the query's
    /// embedding, fused by reciprocal rank.
    pub fn with_embedder(mut self, embedder: Embedder) -> Self {
        self.embedder = Some(embedder);
        self
    }

    /// Records search times in `metrics`.
    pub fn with_metrics(mut self, metrics: RetrievalMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Searches the store: BM25 alone, or, with an embedder and words to
    /// look for, BM25 and vectors fused by reciprocal rank. A query the
    /// embedder cannot embed falls back to BM25 (with a warning in the
    /// log), never to an error.
    pub async fn search(&self, query: &Query) -> Result<Vec<Hit>, ToolError> {
        let vector = self.query_vector(query).await;
        self.search_with(query, vector.as_deref()).await
    }

    /// The query's embedding, when search is hybrid and it has words; a
    /// failure is logged and answered by BM25 alone.
    pub async fn query_vector(&self, query: &Query) -> Option<Vec<f32>> {
        let embedder = self.embedder.as_ref()?;
        if query.vector.is_some() || query.text.trim().is_empty() {
            return None;
        }
        match embedder.embed(std::slice::from_ref(&query.text)).await {
            Ok(mut vectors) => vectors.pop(),
            Err(e) => {
                tracing::warn!(error = %e, "the query could not be embedded; BM25 alone answers it");
                None
            }
        }
    }

    /// [`Retrieval::search`] with the query's embedding already made (a
    /// tool that searches many times embeds its words once).
    pub async fn search_with(
        &self,
        query: &Query,
        vector: Option<&[f32]>,
    ) -> Result<Vec<Hit>, ToolError> {
        let started = Instant::now();
        let mut hits = self.store.search(query).await.map_err(store_error)?;
        if let Some(vector) = vector.filter(|_| !query.text.trim().is_empty()) {
            let by_vector = Query {
                vector: Some(vector.to_vec()),
                ..query.clone()
            };
            let near = self.store.search(&by_vector).await.map_err(store_error)?;
            hits = reciprocal_rank_fusion(&[hits, near], query.top_k);
        }
        if let Some(m) = &self.metrics {
            m.search_duration.observe(started.elapsed().as_secs_f64());
        }
        Ok(hits)
    }

    /// The canonical normalised name of every entity in `names`: an entity
    /// in scope whose name or alias matches exactly after normalisation,
    /// else the most similar one above [`FUZZY_ENTITY_THRESHOLD`], else the
    /// name as given (normalised), which then matches nothing unknown.
    async fn resolve_entities(
        &self,
        scope: &Scope,
        names: &[String],
    ) -> Result<Vec<String>, ToolError> {
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let candidates = self.entity_candidates(scope, name).await?;
            let resolved = match best_entity(&candidates, name) {
                Some((item, _)) => normalize_entity(&item.title),
                None => normalize_entity(name),
            };
            if !resolved.is_empty() {
                out.push(resolved);
            }
        }
        Ok(out)
    }

    /// Entities in scope that may be `name`: those matching its words, and
    /// the newest ones (a misspelled name shares no word).
    async fn entity_candidates(&self, scope: &Scope, name: &str) -> Result<Vec<Item>, ToolError> {
        let mut query = scope.query(name, MAX_TOP_K);
        query.kinds = vec![ItemKind::Entity];
        let by_words = self.search(&query).await?;
        query.text.clear();
        let newest = self.search(&query).await?;
        let mut seen = HashSet::new();
        Ok(by_words
            .into_iter()
            .chain(newest)
            .filter(|h| seen.insert(h.item.id.clone()))
            .map(|h| h.item)
            .collect())
    }
}

/// The best entity for `name` among `candidates`: an exact match (name or
/// alias, normalised) first, else the most similar above the threshold.
/// Returns the item and its similarity (1.0 for exact).
pub fn best_entity<'a>(candidates: &'a [Item], name: &str) -> Option<(&'a Item, f64)> {
    let wanted = normalize_entity(name);
    if wanted.is_empty() {
        return None;
    }
    let names = |item: &'a Item| {
        std::iter::once(&item.title)
            .chain(&item.aliases)
            .map(|n| normalize_entity(n))
    };
    if let Some(exact) = candidates.iter().find(|c| names(c).any(|n| n == wanted)) {
        return Some((exact, 1.0));
    }
    candidates
        .iter()
        .filter_map(|c| {
            let best = names(c)
                .map(|n| strsim::jaro_winkler(&n, &wanted))
                .fold(0.0_f64, f64::max);
            (best >= FUZZY_ENTITY_THRESHOLD).then_some((c, best))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

fn store_error(e: StoreError) -> ToolError {
    match e {
        StoreError::Unavailable(_) | StoreError::Busy(_) => ToolError::transient(e.to_string()),
        StoreError::Invalid(m) => ToolError::invalid(m),
        StoreError::Engine(_) => ToolError::failed(e.to_string()),
    }
}

/// What a call may see, from its headers alone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scope {
    /// The invocation's tenant: nothing outside it is ever seen.
    pub tenant: String,
    pub collections: Vec<String>,
    pub documents: Vec<String>,
    pub owner: Owner,
}

impl Scope {
    /// The chat job's attached documents.
    pub fn attachments(ctx: &ToolCtx) -> Result<Self, ToolError> {
        let documents = ctx.invocation().attached_documents.clone();
        if documents.is_empty() {
            return Err(ToolError::invalid(
                "no documents are attached to this chat, so there is nothing to read; \
                 answer without them or ask the user to attach the documents",
            ));
        }
        Ok(Self {
            tenant: ctx.invocation().tenant().to_owned(),
            documents,
            ..Self::default()
        })
    }

    /// The chat job's data source.
    pub fn data_source(ctx: &ToolCtx) -> Result<Self, ToolError> {
        match &ctx.invocation().data_source_id {
            Some(ds) => Ok(Self {
                tenant: ctx.invocation().tenant().to_owned(),
                collections: vec![ds.clone()],
                ..Self::default()
            }),
            None => Err(ToolError::invalid(
                "this chat has no data source to search; answer without one",
            )),
        }
    }

    /// The job's user (required: without one a context search would see
    /// everyone's items) within its data source when it has one, narrowed
    /// by `narrow`'s device and agent.
    pub fn context(ctx: &ToolCtx, narrow: &OwnerArgs) -> Result<Self, ToolError> {
        let invocation = ctx.invocation();
        if invocation.user.is_none() {
            return Err(ToolError::blocked(
                "context retrieval is per user: this chat job names no user, so there is \
                 no one's knowledge, events, profile or entities to search",
            ));
        }
        Ok(Self {
            tenant: invocation.tenant().to_owned(),
            collections: invocation.data_source_id.iter().cloned().collect(),
            documents: Vec::new(),
            owner: Owner {
                user: invocation.user.clone(),
                device: narrow.device.clone(),
                agent: narrow.agent.clone(),
            },
        })
    }

    fn query(&self, text: &str, top_k: usize) -> Query {
        Query {
            tenant: self.tenant.clone(),
            text: text.to_owned(),
            collections: self.collections.clone(),
            documents: self.documents.clone(),
            owner: self.owner.clone(),
            top_k: top_k.clamp(1, MAX_TOP_K),
            ..Query::default()
        }
    }
}

/// May the job's user see a document owned by `owner`? A document with
/// an owner user is that user's alone; one without is everyone's who
/// attaches it.
fn visible_to(owner: &Owner, user: Option<&str>) -> bool {
    owner.user.is_none() || owner.user.as_deref() == user
}

/// The attachments the job's user may see (documents owned by another
/// user are left out, as if they were not in the index).
async fn attachment_scope(retrieval: &Retrieval, ctx: &ToolCtx) -> Result<Scope, ToolError> {
    let mut scope = Scope::attachments(ctx)?;
    let user = ctx.invocation().user.as_deref();
    let docs = retrieval
        .store
        .list_documents(&scope.tenant, &[], &scope.documents, MAX_TOP_K)
        .await
        .map_err(store_error)?;
    let visible: HashSet<&str> = docs
        .iter()
        .filter(|d| visible_to(&d.owner, user))
        .map(|d| d.id.as_str())
        .collect();
    scope.documents.retain(|id| visible.contains(id.as_str()));
    if scope.documents.is_empty() {
        // Nothing visible: an empty filter would match anything.
        scope.documents.push(String::from("\u{0}none"));
    }
    Ok(scope)
}

/// `device` and `agent` owner ids a context tool may narrow to.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerArgs {
    pub device: Option<String>,
    pub agent: Option<String>,
}

/// Parses a tool's `from`/`to`: an RFC 3339 instant or a `YYYY-MM-DD` day
/// (the whole day: its start for `from`, its last millisecond for `to`).
pub fn time_range(from: Option<&str>, to: Option<&str>) -> Result<TimeRange, ToolError> {
    fn parse(value: &str, end: bool, name: &str) -> Result<i64, ToolError> {
        let bad = || {
            ToolError::invalid(format!(
                "{name} {value:?} is not a date (YYYY-MM-DD) or an RFC 3339 time \
                 (2026-11-24T09:30:00Z)"
            ))
        };
        let ms = if value.len() == 10 {
            let day = time::Date::parse(
                value,
                time::macros::format_description!("[year]-[month]-[day]"),
            )
            .map_err(|_| bad())?;
            let start = day.midnight().assume_utc();
            let ms = (start.unix_timestamp_nanos() / 1_000_000) as i64;
            if end { ms + 86_399_999 } else { ms }
        } else {
            let at = OffsetDateTime::parse(value, &Rfc3339).map_err(|_| bad())?;
            (at.unix_timestamp_nanos() / 1_000_000) as i64
        };
        Ok(ms)
    }
    let range = TimeRange {
        from_ms: from.map(|v| parse(v, false, "from")).transpose()?,
        to_ms: to.map(|v| parse(v, true, "to")).transpose()?,
    };
    if let (Some(f), Some(t)) = (range.from_ms, range.to_ms)
        && f > t
    {
        return Err(ToolError::invalid("from is after to"));
    }
    Ok(range)
}

fn date_of(ms: i64) -> String {
    crate::model::Buckets::of_ms(ms)
        .map(|b| b.day)
        .unwrap_or_default()
}

fn cut(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// An item's title as cited: a document's later chunks say which part
/// they are, so three passages of one document are told apart.
fn display_title(item: &Item) -> String {
    match item.chunk {
        Some(n) if n > 0 => format!("{} (part {})", item.title, n + 1),
        _ => item.title.clone(),
    }
}

/// The reference type of an item: `document` for an attachment's chunk,
/// `data_source` for a data source's, otherwise the item's kind.
fn reference_kind(item: &Item, attachment: bool) -> &'static str {
    match item.kind {
        ItemKind::Document if attachment => "document",
        ItemKind::Document => "data_source",
        kind => kind.as_str(),
    }
}

/// Cites every hit and renders them for the model, one block each, led by
/// its marker; `data` lists them with their reference numbers.
async fn cite_hits(
    retrieval: &Retrieval,
    ctx: &ToolCtx,
    hits: &[Hit],
    attachment: bool,
    empty: String,
) -> Result<ToolOutput, ToolError> {
    if hits.is_empty() {
        return Ok(ToolOutput {
            content: empty,
            data: Some(json!({ "hits": [] })),
        });
    }
    let refs = hits
        .iter()
        .map(|h| NewReference {
            kind: reference_kind(&h.item, attachment).to_owned(),
            title: display_title(&h.item),
            source: h.item.source.clone(),
            url: None,
            snippet: Some(cut(&one_line(&h.item.text), SNIPPET_MAX_CHARS)),
        })
        .collect();
    let cited = ctx.cite(refs).await?;
    if let Some(m) = &retrieval.metrics {
        m.passages_returned.inc_by(hits.len() as u64);
    }
    let content = hits
        .iter()
        .zip(&cited)
        .map(|(h, r)| {
            let mut about = Vec::new();
            if let Some(source) = &h.item.source {
                about.push(source.clone());
            }
            if let Some(level) = h.item.level {
                about.push(format!("L{}", level.number()));
            }
            about.push(date_of(h.item.timestamp_ms));
            format!(
                "{} {} ({}): {}",
                r.marker(),
                display_title(&h.item),
                about.join(", "),
                cut(&h.item.text, PASSAGE_MAX_CHARS)
            )
        })
        .collect::<Vec<_>>()
        .join("\n\n");
    let data: Vec<Value> = hits
        .iter()
        .zip(&cited)
        .map(|(h, r)| {
            json!({
                "reference": r.index,
                "id": h.item.id,
                "kind": h.item.kind.as_str(),
                "title": h.item.title,
                "source": h.item.source,
                "documentId": h.item.document_id,
                "chunk": h.item.chunk,
                "level": h.item.level.map(|l| format!("L{}", l.number())),
                "timestampMs": h.item.timestamp_ms,
                "score": h.score,
            })
        })
        .collect();
    Ok(ToolOutput {
        content,
        data: Some(json!({ "hits": data })),
    })
}

/// Arguments every search shares.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchArgs {
    pub query: String,
    pub top_k: Option<usize>,
    pub from: Option<String>,
    pub to: Option<String>,
    #[serde(default)]
    pub entities: Vec<String>,
    #[serde(flatten)]
    pub owner: OwnerArgs,
}

impl SearchArgs {
    fn top_k(&self) -> usize {
        self.top_k.unwrap_or(DEFAULT_TOP_K).clamp(1, MAX_TOP_K)
    }

    async fn query(
        &self,
        retrieval: &Retrieval,
        scope: &Scope,
        kinds: Vec<ItemKind>,
    ) -> Result<Query, ToolError> {
        let mut query = scope.query(&self.query, self.top_k());
        query.kinds = kinds;
        query.time = time_range(self.from.as_deref(), self.to.as_deref())?;
        query.owner.device = query.owner.device.or(self.owner.device.clone());
        query.owner.agent = query.owner.agent.or(self.owner.agent.clone());
        query.entities = retrieval.resolve_entities(scope, &self.entities).await?;
        Ok(query)
    }
}

/// `retrieval.search_documents`: the attached documents.
pub struct SearchDocuments(pub Retrieval);

impl Tool for SearchDocuments {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = attachment_scope(&self.0, ctx).await?;
        let query = args
            .query(&self.0, &scope, vec![ItemKind::Document])
            .await?;
        let hits = self.0.search(&query).await?;
        let empty = format!(
            "Nothing in the attached documents matched {:?}.",
            args.query
        );
        cite_hits(&self.0, ctx, &hits, true, empty).await
    }
}

/// `retrieval.search_data_sources`: the job's data source.
pub struct SearchDataSources(pub Retrieval);

impl Tool for SearchDataSources {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::data_source(ctx)?;
        let query = args
            .query(&self.0, &scope, vec![ItemKind::Document])
            .await?;
        let hits = self.0.search(&query).await?;
        let empty = format!("Nothing in the data source matched {:?}.", args.query);
        cite_hits(&self.0, ctx, &hits, false, empty).await
    }
}

/// Arguments of [`ListDocuments`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListArgs {
    pub limit: Option<usize>,
}

/// `retrieval.list_documents`: the attached documents, without text.
pub struct ListDocuments(pub Retrieval);

impl Tool for ListDocuments {
    type Args = ListArgs;

    async fn call(&self, ctx: &ToolCtx, args: ListArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::attachments(ctx)?;
        let limit = args.limit.unwrap_or(MAX_TOP_K).clamp(1, MAX_TOP_K);
        let user = ctx.invocation().user.as_deref();
        let mut docs = self
            .0
            .store
            .list_documents(&scope.tenant, &[], &scope.documents, limit)
            .await
            .map_err(store_error)?;
        docs.retain(|d| visible_to(&d.owner, user));
        let found: HashSet<&str> = docs.iter().map(|d| d.id.as_str()).collect();
        let missing: Vec<&String> = scope
            .documents
            .iter()
            .filter(|id| !found.contains(id.as_str()))
            .collect();
        let mut lines: Vec<String> = docs
            .iter()
            .map(|d| {
                format!(
                    "- {} (id {}, {}, {} tokens, {})",
                    d.title,
                    d.id,
                    d.format,
                    d.tokens,
                    date_of(d.timestamp_ms)
                )
            })
            .collect();
        if !missing.is_empty() {
            lines.push(format!(
                "Attached but not in the index (or not this user's): {}",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(ToolOutput {
            content: if lines.is_empty() {
                "No attached document is in the index.".to_owned()
            } else {
                lines.join("\n")
            },
            data: Some(json!({ "documents": docs, "missing": missing })),
        })
    }
}

/// Arguments of [`ReadDocument`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadArgs {
    pub document_id: String,
    pub offset: Option<usize>,
    pub max_chars: Option<usize>,
}

async fn attached_record(
    retrieval: &Retrieval,
    ctx: &ToolCtx,
    id: &str,
) -> Result<crate::store::DocumentRecord, ToolError> {
    let scope = Scope::attachments(ctx)?;
    if !scope.documents.iter().any(|d| d == id) {
        return Err(ToolError::blocked(format!(
            "{id:?} is not one of this chat's attached documents; list_documents shows them"
        )));
    }
    retrieval
        .store
        .document(&scope.tenant, id)
        .await
        .map_err(store_error)?
        .filter(|record| visible_to(&record.owner, ctx.invocation().user.as_deref()))
        .ok_or_else(|| {
            ToolError::invalid(format!(
                "attached document {id:?} is not in the index (or not this user's)"
            ))
        })
}

/// Cites the part of an attached document a read returns: the marker the
/// model quotes and the reference's index.
async fn cite_document(
    ctx: &ToolCtx,
    record: &crate::store::DocumentRecord,
    snippet: String,
) -> Result<(String, Option<u64>), ToolError> {
    let cited = ctx
        .cite(vec![NewReference {
            kind: "document".into(),
            title: record.title.clone(),
            source: Some(record.source.clone()),
            url: None,
            snippet: Some(snippet),
        }])
        .await?;
    let marker = cited.first().map(|r| r.marker()).unwrap_or_default();
    Ok((marker, cited.first().map(|r| r.index)))
}

/// `retrieval.read_document`: an attached document's text, a window at a
/// time.
pub struct ReadDocument(pub Retrieval);

impl Tool for ReadDocument {
    type Args = ReadArgs;

    async fn call(&self, ctx: &ToolCtx, args: ReadArgs) -> Result<ToolOutput, ToolError> {
        let record = attached_record(&self.0, ctx, &args.document_id).await?;
        let total = record.text.chars().count();
        let offset = args.offset.unwrap_or(0);
        if offset > total {
            return Err(ToolError::invalid(format!(
                "offset {offset} is past the end of the document ({total} characters)"
            )));
        }
        let max = args
            .max_chars
            .unwrap_or(READ_DEFAULT_CHARS)
            .clamp(1, READ_MAX_CHARS);
        let text: String = record.text.chars().skip(offset).take(max).collect();
        let end = offset + text.chars().count();
        let (marker, reference) =
            cite_document(ctx, &record, cut(&one_line(&text), SNIPPET_MAX_CHARS)).await?;
        let more = if end < total {
            format!("\n\n(continues: call again with offset {end})")
        } else {
            String::new()
        };
        Ok(ToolOutput {
            content: format!(
                "{marker} {} (characters {offset}–{end} of {total}):\n{text}{more}",
                record.title
            ),
            data: Some(json!({
                "documentId": record.id,
                "reference": reference,
                "offset": offset,
                "end": end,
                "totalChars": total,
            })),
        })
    }
}

/// Arguments of [`ReadTabularData`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TableArgs {
    pub document_id: String,
    #[serde(default)]
    pub columns: Vec<String>,
    pub offset: Option<usize>,
    pub max_rows: Option<usize>,
    pub max_columns: Option<usize>,
}

/// `retrieval.read_tabular_data`: rows of an attached CSV document.
pub struct ReadTabularData(pub Retrieval);

impl Tool for ReadTabularData {
    type Args = TableArgs;

    async fn call(&self, ctx: &ToolCtx, args: TableArgs) -> Result<ToolOutput, ToolError> {
        let record = attached_record(&self.0, ctx, &args.document_id).await?;
        let Some(raw) = record.raw.as_deref().filter(|_| record.format == "csv") else {
            return Err(ToolError::invalid(format!(
                "{:?} is {}, not tabular data; use read_document",
                record.id, record.format
            )));
        };
        let table = parse_csv(raw).map_err(|e| ToolError::failed(e.to_string()))?;
        let window = TableWindow::of(&table, &args)?;
        let rows = format!(
            "rows {}–{} of {}",
            window.offset + 1,
            window.end,
            table.rows.len()
        );
        let (marker, reference) = cite_document(ctx, &record, rows).await?;
        Ok(ToolOutput {
            content: window.render(&marker, &record.title, table.rows.len()),
            data: Some(json!({
                "documentId": record.id,
                "reference": reference,
                "columns": window.names,
                "rows": window.rows,
                "offset": window.offset,
                "totalRows": table.rows.len(),
                "raggedRows": table.ragged_rows,
            })),
        })
    }
}

/// The rows and columns of a table one [`ReadTabularData`] call reads.
struct TableWindow {
    /// The table's widest row (or its header), in columns.
    width: usize,
    /// The names of the columns read.
    names: Vec<String>,
    rows: Vec<Vec<String>>,
    /// The first row read (0-based) and the one after the last.
    offset: usize,
    end: usize,
    /// Whether `maxColumns` left columns out.
    columns_cut: bool,
}

impl TableWindow {
    fn of(table: &Table, args: &TableArgs) -> Result<Self, ToolError> {
        let width = table
            .rows
            .iter()
            .map(Vec::len)
            .chain([table.header.len()])
            .max()
            .unwrap_or(0);
        let mut columns = pick_columns(table, width, &args.columns)?;
        let max_columns = args
            .max_columns
            .unwrap_or(TABLE_DEFAULT_COLUMNS)
            .clamp(1, TABLE_MAX_COLUMNS);
        let columns_cut = columns.len() > max_columns;
        columns.truncate(max_columns);
        let offset = args.offset.unwrap_or(0);
        if offset > table.rows.len() {
            return Err(ToolError::invalid(format!(
                "offset {offset} is past the last row ({} rows)",
                table.rows.len()
            )));
        }
        let max_rows = args
            .max_rows
            .unwrap_or(TABLE_DEFAULT_ROWS)
            .clamp(1, TABLE_MAX_ROWS);
        let names: Vec<String> = columns
            .iter()
            .map(|&i| column_name(&table.header, i))
            .collect();
        let rows: Vec<Vec<String>> = table
            .rows
            .iter()
            .skip(offset)
            .take(max_rows)
            .map(|row| {
                columns
                    .iter()
                    .map(|&i| row.get(i).cloned().unwrap_or_default())
                    .collect()
            })
            .collect();
        Ok(Self {
            width,
            names,
            end: offset + rows.len(),
            rows,
            offset,
            columns_cut,
        })
    }

    /// The window as the model reads it: a Markdown table under the
    /// citation marker, with how to read more.
    fn render(&self, marker: &str, title: &str, total_rows: usize) -> String {
        let (offset, end) = (self.offset, self.end);
        let mut content = format!(
            "{marker} {title} (rows {}–{end} of {total_rows}, {} of {} columns):\n| {} |",
            (offset + 1).min(end.max(1)),
            self.names.len(),
            self.width,
            self.names.join(" | ")
        );
        for row in &self.rows {
            content.push_str(&format!("\n| {} |", row.join(" | ")));
        }
        if end < total_rows {
            content.push_str(&format!("\n(more rows: call again with offset {end})"));
        }
        if self.columns_cut {
            content.push_str("\n(more columns: name the ones you need in columns)");
        }
        content
    }
}

/// The columns a call names (any case), or all of them when it names none.
fn pick_columns(table: &Table, width: usize, wanted: &[String]) -> Result<Vec<usize>, ToolError> {
    if wanted.is_empty() {
        return Ok((0..width).collect());
    }
    wanted
        .iter()
        .map(|wanted| {
            (0..width)
                .find(|&i| column_name(&table.header, i).eq_ignore_ascii_case(wanted))
                .ok_or_else(|| {
                    ToolError::invalid(format!(
                        "no column {wanted:?}; the columns are: {}",
                        (0..width)
                            .map(|i| column_name(&table.header, i))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })
        })
        .collect()
}

/// `retrieval.retrieve_knowledge_context`: knowledge items and L0 events,
/// merged (de-duplicated by id keeping the higher score, best first).
pub struct RetrieveKnowledgeContext(pub Retrieval);

impl Tool for RetrieveKnowledgeContext {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::context(ctx, &args.owner)?;
        let knowledge = args
            .query(&self.0, &scope, vec![ItemKind::Knowledge])
            .await?;
        let mut events = knowledge.clone();
        events.kinds = vec![ItemKind::Event];
        events.levels = vec![Level::L0];
        // One embedding of the words serves both searches.
        let vector = self.0.query_vector(&knowledge).await;
        let lists = [
            self.0.search_with(&knowledge, vector.as_deref()).await?,
            self.0.search_with(&events, vector.as_deref()).await?,
        ];
        let hits = merge_keep_best(lists, args.top_k());
        let empty = format!("No knowledge matched {:?}.", args.query);
        cite_hits(&self.0, ctx, &hits, false, empty).await
    }
}

/// `retrieval.retrieve_event_context`: L1–L3 summaries in the range's
/// buckets, drilled down breadth-first through child ids to L0 (a child
/// scores `PARENT_WEIGHT × parent + (1 − PARENT_WEIGHT) × own`), plus a
/// direct L0 search as fallback; merged, de-duplicated, cut to top_k.
pub struct RetrieveEventContext(pub Retrieval);

impl RetrieveEventContext {
    /// The ranked events for `query` (its levels and buckets are set here).
    pub async fn events(&self, base: &Query) -> Result<Vec<Hit>, ToolError> {
        let mut summaries = base.clone();
        summaries.kinds = vec![ItemKind::Event];
        summaries.levels = vec![Level::L1, Level::L2, Level::L3];
        if let (Some(from), Some(to)) = (base.time.from_ms, base.time.to_ms) {
            summaries.buckets = [Level::L1, Level::L2, Level::L3]
                .into_iter()
                .flat_map(|level| {
                    crate::model::Buckets::keys_in_range(level, from, to, MAX_BUCKETS)
                })
                .collect();
            // A summary's bucket says where it is; its own timestamp (often
            // the period's start) may fall outside a range its bucket meets.
            summaries.time = TimeRange::default();
        }
        // The words are embedded once for every search below.
        let vector = self.0.query_vector(base).await;
        let vector = vector.as_deref();
        let mut drilled: Vec<Hit> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut frontier: VecDeque<Hit> = self.0.search_with(&summaries, vector).await?.into();
        while let Some(parent) = frontier.pop_front() {
            if !seen.insert(parent.item.id.clone()) {
                continue;
            }
            if seen.len() > MAX_EXPANDED {
                break;
            }
            let children: Vec<String> = parent
                .item
                .child_ids
                .iter()
                .filter(|id| !seen.contains(*id))
                .take(MAX_CHILDREN)
                .cloned()
                .collect();
            if !children.is_empty() {
                let mut q = base.clone();
                q.kinds = vec![ItemKind::Event];
                q.ids = children.clone();
                q.top_k = children.len().min(MAX_TOP_K);
                // Children matching the words score by them; the others
                // still belong to a matching summary.
                let scored: HashMap<String, f32> = self
                    .0
                    .search_with(&q, vector)
                    .await?
                    .into_iter()
                    .map(|h| (h.item.id, h.score))
                    .collect();
                q.text.clear();
                for child in self.0.search(&q).await? {
                    let own = scored.get(&child.item.id).copied().unwrap_or(0.0);
                    frontier.push_back(Hit {
                        score: PARENT_WEIGHT * parent.score + (1.0 - PARENT_WEIGHT) * own,
                        item: child.item,
                    });
                }
            }
            drilled.push(parent);
        }
        let mut direct = base.clone();
        direct.kinds = vec![ItemKind::Event];
        direct.levels = vec![Level::L0];
        let direct = self.0.search_with(&direct, vector).await?;
        Ok(merge_keep_best([drilled, direct], base.top_k))
    }
}

impl Tool for RetrieveEventContext {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::context(ctx, &args.owner)?;
        let query = args.query(&self.0, &scope, vec![ItemKind::Event]).await?;
        let hits = self.events(&query).await?;
        let empty = format!("No events matched {:?}.", args.query);
        cite_hits(&self.0, ctx, &hits, false, empty).await
    }
}

/// `retrieval.retrieve_profile_context`: profile items (newest first when
/// the query is empty).
pub struct RetrieveProfileContext(pub Retrieval);

impl Tool for RetrieveProfileContext {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::context(ctx, &args.owner)?;
        let query = args.query(&self.0, &scope, vec![ItemKind::Profile]).await?;
        let hits = self.0.search(&query).await?;
        cite_hits(
            &self.0,
            ctx,
            &hits,
            false,
            "No profile information found.".to_owned(),
        )
        .await
    }
}

/// What [`EntityLookup`] does.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EntityMode {
    /// The entity whose name or alias is `name` (normalised).
    #[default]
    Exact,
    /// Entities whose names are like `name`, most similar first.
    Similar,
    /// Entities in scope (matching `name`'s words when given).
    List,
    /// The entity's relations, and entities related to it.
    Relationships,
}

/// Arguments of [`EntityLookup`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EntityArgs {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub mode: EntityMode,
    pub top_k: Option<usize>,
    #[serde(flatten)]
    pub owner: OwnerArgs,
}

/// `retrieval.entity_lookup`.
pub struct EntityLookup(pub Retrieval);

impl Tool for EntityLookup {
    type Args = EntityArgs;

    async fn call(&self, ctx: &ToolCtx, args: EntityArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::context(ctx, &args.owner)?;
        let top_k = args.top_k.unwrap_or(DEFAULT_TOP_K).clamp(1, MAX_TOP_K);
        let needs_name = args.mode != EntityMode::List;
        if needs_name && normalize_entity(&args.name).is_empty() {
            return Err(ToolError::invalid(
                "name is required (letters or digits) for exact, similar and relationships",
            ));
        }
        let candidates = self.0.entity_candidates(&scope, &args.name).await?;
        let hits: Vec<Hit> = match args.mode {
            EntityMode::Exact => best_entity(&candidates, &args.name)
                .filter(|(_, s)| *s >= 1.0)
                .map(|(item, s)| Hit {
                    item: item.clone(),
                    score: s as f32,
                })
                .into_iter()
                .collect(),
            EntityMode::Similar => similar_entities(&candidates, &args.name, top_k),
            EntityMode::List => {
                let mut query = scope.query(&args.name, top_k);
                query.kinds = vec![ItemKind::Entity];
                self.0.search(&query).await?
            }
            EntityMode::Relationships => {
                let Some(related) = related_entities(&candidates, &args.name, top_k) else {
                    return Ok(ToolOutput {
                        content: format!("No entity named {:?}.", args.name),
                        data: Some(json!({ "hits": [] })),
                    });
                };
                related
            }
        };
        let mut output = cite_hits(
            &self.0,
            ctx,
            &hits,
            false,
            format!("No entity matched {:?}.", args.name),
        )
        .await?;
        // Relations are the point of an entity: list them with each.
        if !hits.is_empty() {
            let relations: Vec<String> = hits
                .iter()
                .flat_map(|h| {
                    h.item
                        .relations
                        .iter()
                        .map(move |r| format!("{} —{}→ {}", h.item.title, r.kind, r.target))
                })
                .collect();
            if !relations.is_empty() {
                output.content.push_str("\n\nRelations:\n");
                output.content.push_str(&relations.join("\n"));
            }
        }
        Ok(output)
    }
}

/// Entities whose name or an alias is close to `name` (Jaro-Winkler),
/// best first.
fn similar_entities(candidates: &[Item], name: &str, top_k: usize) -> Vec<Hit> {
    let wanted = normalize_entity(name);
    let mut similar: Vec<Hit> = candidates
        .iter()
        .map(|c| {
            let best = std::iter::once(&c.title)
                .chain(&c.aliases)
                .map(|n| strsim::jaro_winkler(&normalize_entity(n), &wanted))
                .fold(0.0_f64, f64::max);
            Hit {
                item: c.clone(),
                score: best as f32,
            }
        })
        .filter(|h| f64::from(h.score) >= FUZZY_ENTITY_THRESHOLD - 0.1)
        .collect();
    similar.sort_by(|a, b| b.score.total_cmp(&a.score));
    similar.truncate(top_k);
    similar
}

/// The entity `name` names, then the entities whose relations point at
/// it; `None` when no entity is named so.
fn related_entities(candidates: &[Item], name: &str, top_k: usize) -> Option<Vec<Hit>> {
    let (entity, _) = best_entity(candidates, name)?;
    let me = normalize_entity(&entity.title);
    let mut related = vec![Hit {
        item: entity.clone(),
        score: 1.0,
    }];
    for other in candidates {
        if other.id != entity.id
            && other
                .relations
                .iter()
                .any(|r| normalize_entity(&r.target) == me)
        {
            related.push(Hit {
                item: other.clone(),
                score: 0.5,
            });
        }
    }
    related.truncate(top_k);
    Some(related)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Relation;
    use crate::store::DocumentRecord;
    use crate::tantivy_store::TantivyStore;
    use toolfleet_worker::TestCtx;
    use toolfleet_worker::protocol::{DEFAULT_TENANT, InvocationContext};

    const DAY: i64 = 86_400_000;
    /// 2026-11-02T00:00:00Z, a Monday.
    const NOV2: i64 = 1_793_577_600_000;

    fn item(id: &str, kind: ItemKind, collection: &str, title: &str, text: &str) -> Item {
        Item {
            id: id.into(),
            kind,
            collection: collection.into(),
            document_id: None,
            chunk: None,
            title: title.into(),
            text: text.into(),
            source: None,
            owner: Owner::default(),
            timestamp_ms: NOV2,
            ingested_ms: NOV2,
            entities: vec![],
            level: None,
            child_ids: vec![],
            aliases: vec![],
            relations: vec![],
            embedding: None,
        }
    }

    async fn document(store: &TantivyStore, collection: &str, path: &str, text: &str, csv: bool) {
        let id = format!("{collection}:{path}");
        let mut chunk = item(
            &format!("{id}#0"),
            ItemKind::Document,
            collection,
            path,
            text,
        );
        chunk.document_id = Some(id.clone());
        chunk.chunk = Some(0);
        chunk.source = Some(path.into());
        let record = DocumentRecord {
            id,
            collection: collection.into(),
            title: path.into(),
            source: path.into(),
            format: if csv { "csv" } else { "markdown" }.into(),
            owner: Owner::default(),
            text: text.into(),
            raw: csv.then(|| text.to_owned()),
            timestamp_ms: NOV2,
            ingested_ms: NOV2,
            chunks: 1,
            tokens: 10,
        };
        store
            .replace_document(DEFAULT_TENANT, record, vec![chunk])
            .await
            .unwrap();
    }

    async fn store() -> (tempfile::TempDir, Retrieval) {
        let dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(dir.path()).unwrap();
        document(
            &store,
            "uploads",
            "mine.md",
            "The hive inspection checklist: frames, brood, queen.",
            false,
        )
        .await;
        document(
            &store,
            "uploads",
            "theirs.md",
            "Another chat's hive inspection notes, secret.",
            false,
        )
        .await;
        document(
            &store,
            "handbook",
            "care.md",
            "Hive care in winter: insulate the hive.",
            false,
        )
        .await;
        document(
            &store,
            "other",
            "care.md",
            "Planted: hive care for another data source.",
            false,
        )
        .await;
        document(
            &store,
            "uploads",
            "sales.csv",
            "region,month,amount\nnorth,jan,10\nsouth,jan,20\nnorth,feb,30\neast\n",
            true,
        )
        .await;
        (dir, Retrieval::new(Arc::new(store)))
    }

    fn ctx(attached: &[&str], data_source: Option<&str>, user: Option<&str>) -> TestCtx {
        TestCtx::new().with_invocation(InvocationContext {
            attached_documents: attached.iter().map(|s| s.to_string()).collect(),
            data_source_id: data_source.map(Into::into),
            user: user.map(Into::into),
            ..InvocationContext::new("inv-1")
        })
    }

    fn ids(output: &ToolOutput) -> Vec<String> {
        output.data.as_ref().unwrap()["hits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["id"].as_str().unwrap().to_owned())
            .collect()
    }

    #[tokio::test]
    async fn document_tools_see_only_the_attached_documents() {
        let (_dir, r) = store().await;
        let test = ctx(
            &["uploads:mine.md", "uploads:sales.csv"],
            Some("handbook"),
            None,
        );
        let out = test
            .call(
                &SearchDocuments(r.clone()),
                json!({ "query": "hive inspection" }),
            )
            .await
            .unwrap();
        assert_eq!(ids(&out), ["uploads:mine.md#0"]);
        assert!(
            out.content
                .starts_with("[doc:1] mine.md (mine.md, 2026-11-02): The hive"),
            "{}",
            out.content
        );
        let refs = test.references();
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].kind, "document");
        assert_eq!(refs[0].source.as_deref(), Some("mine.md"));

        // The planted document is in the index but never reachable.
        let e = test
            .call(
                &ReadDocument(r.clone()),
                json!({ "documentId": "uploads:theirs.md" }),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), "blocked", "{e}");
        let listed = test
            .call(&ListDocuments(r.clone()), json!({}))
            .await
            .unwrap();
        assert!(
            listed.content.contains("uploads:mine.md")
                && listed.content.contains("uploads:sales.csv")
        );
        assert!(!listed.content.contains("theirs"), "{}", listed.content);

        let read = test
            .call(
                &ReadDocument(r.clone()),
                json!({ "documentId": "uploads:mine.md", "offset": 4, "maxChars": 10 }),
            )
            .await
            .unwrap();
        assert!(read.content.starts_with("[doc:2] mine.md (characters 4–14 of 52):\nhive inspe\n\n(continues: call again with offset 14)"), "{}", read.content);

        // Nothing attached: a clear error, not the whole index.
        let e = ctx(&[], Some("handbook"), None)
            .call(&SearchDocuments(r.clone()), json!({ "query": "hive" }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_input");
        assert!(e.to_string().contains("no documents are attached"), "{e}");
        // An attachment that was never ingested is listed as missing.
        let out = ctx(&["uploads:gone.md"], None, None)
            .call(&ListDocuments(r.clone()), json!({}))
            .await
            .unwrap();
        assert!(
            out.content
                .contains("not in the index (or not this user's): uploads:gone.md"),
            "{}",
            out.content
        );
    }

    #[tokio::test]
    async fn another_users_upload_stays_theirs_even_when_attached() {
        let (dir, r) = store().await;
        drop(r);
        let store = TantivyStore::open(dir.path()).unwrap();
        let mut chunk = item(
            "uploads:private.md#0",
            ItemKind::Document,
            "uploads",
            "private.md",
            "Private hive inspection diary.",
        );
        chunk.document_id = Some("uploads:private.md".into());
        chunk.chunk = Some(0);
        chunk.owner.user = Some("u2".into());
        let record = DocumentRecord {
            id: "uploads:private.md".into(),
            collection: "uploads".into(),
            title: "private.md".into(),
            source: "private.md".into(),
            format: "markdown".into(),
            owner: chunk.owner.clone(),
            text: chunk.text.clone(),
            raw: None,
            timestamp_ms: NOV2,
            ingested_ms: NOV2,
            chunks: 1,
            tokens: 5,
        };
        store
            .replace_document(DEFAULT_TENANT, record, vec![chunk])
            .await
            .unwrap();
        let r = Retrieval::new(Arc::new(store));
        let attach = ["uploads:private.md", "uploads:mine.md"];
        let stranger = ctx(&attach, None, Some("u1"));
        let out = stranger
            .call(
                &SearchDocuments(r.clone()),
                json!({ "query": "hive inspection diary" }),
            )
            .await
            .unwrap();
        assert_eq!(ids(&out), ["uploads:mine.md#0"]);
        let e = stranger
            .call(
                &ReadDocument(r.clone()),
                json!({ "documentId": "uploads:private.md" }),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not this user's"), "{e}");
        let listed = stranger
            .call(&ListDocuments(r.clone()), json!({}))
            .await
            .unwrap();
        assert!(
            !listed.content.contains("- private.md"),
            "{}",
            listed.content
        );
        // Only its private upload attached: nothing, not everything.
        let out = ctx(&["uploads:private.md"], None, Some("u1"))
            .call(&SearchDocuments(r.clone()), json!({ "query": "hive" }))
            .await
            .unwrap();
        assert!(ids(&out).is_empty());
        // Its owner reads it.
        let owner = ctx(&attach, None, Some("u2"));
        let out = owner
            .call(&SearchDocuments(r.clone()), json!({ "query": "diary" }))
            .await
            .unwrap();
        assert_eq!(ids(&out), ["uploads:private.md#0"]);
    }

    #[tokio::test]
    async fn the_data_source_search_sees_only_the_jobs_data_source() {
        let (_dir, r) = store().await;
        let test = ctx(&["uploads:mine.md"], Some("handbook"), None);
        let out = test
            .call(
                &SearchDataSources(r.clone()),
                json!({ "query": "hive care" }),
            )
            .await
            .unwrap();
        assert_eq!(ids(&out), ["handbook:care.md#0"]);
        assert_eq!(test.references()[0].kind, "data_source");
        let e = ctx(&[], None, Some("u1"))
            .call(&SearchDataSources(r.clone()), json!({ "query": "hive" }))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no data source"), "{e}");
        // Only stop words: an empty result, not an error.
        let out = test
            .call(
                &SearchDataSources(r.clone()),
                json!({ "query": "the and of" }),
            )
            .await
            .unwrap();
        assert!(ids(&out).is_empty());
        assert!(
            out.content
                .starts_with("Nothing in the data source matched")
        );
    }

    #[tokio::test]
    async fn tabular_data_is_read_with_row_and_column_limits() {
        let (_dir, r) = store().await;
        let test = ctx(&["uploads:sales.csv", "uploads:mine.md"], None, None);
        let out = test
            .call(
                &ReadTabularData(r.clone()),
                json!({ "documentId": "uploads:sales.csv", "columns": ["Amount", "region"], "offset": 1, "maxRows": 2 }),
            )
            .await
            .unwrap();
        assert_eq!(
            out.content,
            "[doc:1] sales.csv (rows 2–3 of 4, 2 of 3 columns):\n| amount | region |\n| 20 | south |\n| 30 | north |\n(more rows: call again with offset 3)"
        );
        let data = out.data.unwrap();
        assert_eq!(data["raggedRows"], 1);
        assert_eq!(data["totalRows"], 4);
        let e = test
            .call(
                &ReadTabularData(r.clone()),
                json!({ "documentId": "uploads:sales.csv", "columns": ["price"] }),
            )
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("no column \"price\"; the columns are: region, month, amount"),
            "{e}"
        );
        let e = test
            .call(
                &ReadTabularData(r.clone()),
                json!({ "documentId": "uploads:mine.md" }),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not tabular"), "{e}");
        let out = test
            .call(
                &ReadTabularData(r.clone()),
                json!({ "documentId": "uploads:sales.csv", "maxColumns": 1 }),
            )
            .await
            .unwrap();
        assert!(
            out.content.contains("| region |\n| north |"),
            "{}",
            out.content
        );
        assert!(
            out.content
                .ends_with("(more columns: name the ones you need in columns)")
        );
    }

    async fn context_items(r: &Retrieval) {
        let mut items = Vec::new();
        let mut k = item(
            "k-mine",
            ItemKind::Knowledge,
            "handbook",
            "Swarming",
            "Bees swarm in spring when the hive is crowded.",
        );
        k.owner.user = Some("u1".into());
        k.entities = vec!["Zoë O'Brien".into()];
        items.push(k);
        let mut k2 = item(
            "k-other-user",
            ItemKind::Knowledge,
            "handbook",
            "Swarming",
            "Bees swarm in spring, other user.",
        );
        k2.owner.user = Some("u2".into());
        items.push(k2);
        let mut old = item(
            "k-old",
            ItemKind::Knowledge,
            "handbook",
            "Swarming",
            "Bees swarm, an old note.",
        );
        old.owner.user = Some("u1".into());
        old.timestamp_ms = NOV2 - 400 * DAY;
        items.push(old);
        let mut phone = item(
            "k-phone",
            ItemKind::Knowledge,
            "handbook",
            "Swarming",
            "Bees swarm, noted on the phone.",
        );
        phone.owner = Owner {
            user: Some("u1".into()),
            device: Some("phone".into()),
            agent: None,
        };
        items.push(phone);
        // Events: a month summary over a week summary over a day summary
        // over two L0 events, and an L0 event no summary covers.
        let event = |id: &str, level: Level, text: &str, children: &[&str], at: i64| {
            let mut e = item(id, ItemKind::Event, "handbook", id, text);
            e.level = Some(level);
            e.child_ids = children.iter().map(|c| c.to_string()).collect();
            e.timestamp_ms = at;
            e.owner.user = Some("u1".into());
            e
        };
        items.push(event(
            "m-nov",
            Level::L3,
            "November: harvest and varroa treatment",
            &["w-45"],
            NOV2,
        ));
        items.push(event(
            "w-45",
            Level::L2,
            "Week 45: varroa treatment applied",
            &["d-3"],
            NOV2,
        ));
        items.push(event(
            "d-3",
            Level::L1,
            "Tuesday: treatment day",
            &["e-oxalic", "e-lunch"],
            NOV2 + DAY,
        ));
        items.push(event(
            "e-oxalic",
            Level::L0,
            "Applied oxalic acid against varroa mites",
            &[],
            NOV2 + DAY + 3_600_000,
        ));
        items.push(event(
            "e-lunch",
            Level::L0,
            "Had lunch with the inspector",
            &[],
            NOV2 + DAY + 7_200_000,
        ));
        items.push(event(
            "e-lone",
            Level::L0,
            "Counted varroa on the sticky board",
            &[],
            NOV2 + 3 * DAY,
        ));
        items.push(event(
            "e-dec",
            Level::L0,
            "Varroa count in December",
            &[],
            NOV2 + 40 * DAY,
        ));
        // Entities.
        let mut zoe = item(
            "ent-zoe",
            ItemKind::Entity,
            "handbook",
            "Zoë O'Brien",
            "Beekeeper of the north apiary",
        );
        zoe.aliases = vec!["Z. O'Brien".into()];
        zoe.relations = vec![Relation {
            kind: "works_at".into(),
            target: "North Apiary".into(),
        }];
        zoe.owner.user = Some("u1".into());
        let mut apiary = item(
            "ent-apiary",
            ItemKind::Entity,
            "handbook",
            "North Apiary",
            "The apiary by the river",
        );
        apiary.owner.user = Some("u1".into());
        let mut sam = item(
            "ent-sam",
            ItemKind::Entity,
            "handbook",
            "Sam Reed",
            "Supplier of frames",
        );
        sam.relations = vec![Relation {
            kind: "supplies".into(),
            target: "north apiary".into(),
        }];
        sam.owner.user = Some("u1".into());
        items.extend([zoe, apiary, sam]);
        let mut profile = item(
            "p-1",
            ItemKind::Profile,
            "handbook",
            "Preferences",
            "Prefers metric units and short answers.",
        );
        profile.owner.user = Some("u1".into());
        items.push(profile);
        r.store().upsert_items(DEFAULT_TENANT, items).await.unwrap();
    }

    #[tokio::test]
    async fn knowledge_context_is_scoped_filtered_and_merged_with_l0_events() {
        let (_dir, r) = store().await;
        context_items(&r).await;
        let test = ctx(&[], Some("handbook"), Some("u1"));
        let tool = RetrieveKnowledgeContext(r.clone());
        let out = test
            .call(&tool, json!({ "query": "bees swarm", "topK": 10 }))
            .await
            .unwrap();
        let mut got = ids(&out);
        got.sort();
        assert_eq!(got, ["k-mine", "k-old", "k-phone"], "another user's never");
        // Time range.
        let out = test
            .call(
                &tool,
                json!({ "query": "bees swarm", "from": "2026-01-01" }),
            )
            .await
            .unwrap();
        assert!(!ids(&out).contains(&"k-old".to_owned()));
        // Owner narrowing.
        let out = test
            .call(&tool, json!({ "query": "bees swarm", "device": "phone" }))
            .await
            .unwrap();
        assert_eq!(ids(&out), ["k-phone"]);
        // top_k.
        let out = test
            .call(&tool, json!({ "query": "bees swarm", "topK": 1 }))
            .await
            .unwrap();
        assert_eq!(ids(&out).len(), 1);
        // Entity filters resolve names: exact after normalisation, an alias,
        // and a misspelling (fuzzy); an unknown one filters everything out.
        for name in ["zoe obrien", "Z. O'Brien", "Zoe O'Brein"] {
            let out = test
                .call(&tool, json!({ "query": "bees swarm", "entities": [name] }))
                .await
                .unwrap();
            assert_eq!(ids(&out), ["k-mine"], "{name}");
        }
        let out = test
            .call(
                &tool,
                json!({ "query": "bees swarm", "entities": ["Nobody Known"] }),
            )
            .await
            .unwrap();
        assert!(ids(&out).is_empty());
        // L0 events join knowledge; summaries do not.
        let out = test
            .call(&tool, json!({ "query": "varroa", "topK": 10 }))
            .await
            .unwrap();
        let mut got = ids(&out);
        got.sort();
        assert_eq!(got, ["e-dec", "e-lone", "e-oxalic"]);
        // Neither user nor data source: refused.
        let e = ctx(&[], None, None)
            .call(&tool, json!({ "query": "bees" }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "blocked");
        let e = test
            .call(&tool, json!({ "query": "bees", "from": "yesterday" }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_input");
        assert!(e.to_string().contains("YYYY-MM-DD"), "{e}");
    }

    #[tokio::test]
    async fn event_context_drills_down_from_summaries_to_l0_events() {
        let (_dir, r) = store().await;
        context_items(&r).await;
        let test = ctx(&[], Some("handbook"), Some("u1"));
        let tool = RetrieveEventContext(r.clone());
        let out = test
            .call(&tool, json!({ "query": "varroa treatment", "from": "2026-11-01", "to": "2026-11-30", "topK": 20 }))
            .await
            .unwrap();
        let got = ids(&out);
        // The summaries, the drilled-down children (even the lunch that
        // shares no word, through its parent), and the direct L0 hit; not
        // December's event, outside the range.
        for want in ["m-nov", "w-45", "d-3", "e-oxalic", "e-lunch", "e-lone"] {
            assert!(
                got.contains(&want.to_owned()),
                "{want} missing from {got:?}"
            );
        }
        assert!(!got.contains(&"e-dec".to_owned()), "{got:?}");
        let data = out.data.unwrap();
        let score = |id: &str| {
            data["hits"]
                .as_array()
                .unwrap()
                .iter()
                .find(|h| h["id"] == id)
                .unwrap()["score"]
                .as_f64()
                .unwrap()
        };
        // A matching child outranks a non-matching sibling.
        assert!(score("e-oxalic") > score("e-lunch"));
        // Scores are sorted.
        let scores: Vec<f64> = data["hits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["score"].as_f64().unwrap())
            .collect();
        assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
        assert!(out.content.contains("(L3, 2026-11-02)"), "{}", out.content);
        // top_k cuts the merged list.
        let out = test
            .call(&tool, json!({ "query": "varroa treatment", "topK": 2 }))
            .await
            .unwrap();
        assert_eq!(ids(&out).len(), 2);
        // No summary matches: the direct L0 search still answers.
        let out = test
            .call(&tool, json!({ "query": "sticky board" }))
            .await
            .unwrap();
        assert_eq!(ids(&out), ["e-lone"]);
    }

    #[tokio::test]
    async fn entities_are_looked_up_exactly_fuzzily_listed_and_related() {
        let (_dir, r) = store().await;
        context_items(&r).await;
        let test = ctx(&[], Some("handbook"), Some("u1"));
        let tool = EntityLookup(r.clone());
        let out = test
            .call(&tool, json!({ "name": "ZOE  o'brien", "mode": "exact" }))
            .await
            .unwrap();
        assert_eq!(ids(&out), ["ent-zoe"]);
        assert!(
            out.content.contains("Zoë O'Brien —works_at→ North Apiary"),
            "{}",
            out.content
        );
        let out = test
            .call(&tool, json!({ "name": "Zoey OBrian", "mode": "exact" }))
            .await
            .unwrap();
        assert!(ids(&out).is_empty(), "exact is exact");
        let out = test
            .call(&tool, json!({ "name": "Zoey OBrian", "mode": "similar" }))
            .await
            .unwrap();
        assert_eq!(ids(&out)[0], "ent-zoe");
        let out = test
            .call(&tool, json!({ "mode": "list", "topK": 10 }))
            .await
            .unwrap();
        assert_eq!(ids(&out).len(), 3);
        let out = test
            .call(
                &tool,
                json!({ "name": "north apiary", "mode": "relationships" }),
            )
            .await
            .unwrap();
        let got = ids(&out);
        assert_eq!(got[0], "ent-apiary");
        let mut rest = got[1..].to_vec();
        rest.sort();
        assert_eq!(rest, ["ent-sam", "ent-zoe"]);
        let e = test
            .call(&tool, json!({ "name": "  ", "mode": "similar" }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_input");
        // Another user's scope sees none of them.
        let out = ctx(&[], None, Some("u2"))
            .call(&tool, json!({ "mode": "list" }))
            .await
            .unwrap();
        assert!(ids(&out).is_empty());
    }

    #[tokio::test]
    async fn profile_context_is_the_users_own() {
        let (_dir, r) = store().await;
        context_items(&r).await;
        let tool = RetrieveProfileContext(r.clone());
        let out = ctx(&[], None, Some("u1"))
            .call(&tool, json!({ "query": "" }))
            .await
            .unwrap();
        assert_eq!(ids(&out), ["p-1"]);
        let out = ctx(&[], None, Some("u2"))
            .call(&tool, json!({ "query": "" }))
            .await
            .unwrap();
        assert!(ids(&out).is_empty());
    }

    #[test]
    fn time_ranges_take_dates_and_instants() {
        let r = time_range(Some("2026-11-02"), Some("2026-11-02")).unwrap();
        assert_eq!(r.from_ms, Some(NOV2));
        assert_eq!(r.to_ms, Some(NOV2 + DAY - 1));
        let r = time_range(Some("2026-11-02T01:00:00+01:00"), None).unwrap();
        assert_eq!(r.from_ms, Some(NOV2));
        assert!(time_range(Some("2026-11-03"), Some("2026-11-02")).is_err());
        assert!(time_range(Some("2026-13-01"), None).is_err());
    }
}

#[cfg(test)]
mod hybrid {
    use super::*;
    use crate::embed::{EmbedderConfig, item_input};
    use crate::tantivy_store::TantivyStore;
    use toolfleet_worker::TestCtx;
    use toolfleet_worker::protocol::{DEFAULT_TENANT, InvocationContext};

    /// A word longer than the BM25 analyzer keeps (40 bytes): only the
    /// vector side can find it.
    const LONG: &str = "pneumonoultramicroscopicsilicovolcanoconiosis";

    async fn scripted() -> toolfleet_scripted::ScriptedServer {
        let script = toolfleet_scripted::Script::from_json(r#"{ "rules": [] }"#).unwrap();
        toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
            .await
            .unwrap()
    }

    fn embedder_at(base_url: url::Url) -> Embedder {
        Embedder::new(EmbedderConfig {
            base_url,
            model: "scripted-embedding".into(),
            api_key: Some("sk-embed-secret".into()),
            dimensions: Some(64),
            timeout: std::time::Duration::from_secs(5),
        })
        .unwrap()
    }

    #[tokio::test]
    async fn with_embeddings_search_fuses_bm25_and_vectors() {
        let model = scripted().await;
        let embedder = embedder_at(model.base_url().join("v1/").unwrap());
        let dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(dir.path()).unwrap();
        let mut items = Vec::new();
        for (id, text) in [
            ("lexical", "silicosis is a lung disease of miners"),
            ("semantic", &*format!("the word {LONG} names it")),
            ("unrelated", "bread rises with yeast"),
        ] {
            let mut item = crate::conformance::chunk("d", 0, text);
            item.id = id.into();
            item.kind = ItemKind::Knowledge;
            item.document_id = None;
            item.chunk = None;
            item.collection = "ds".into();
            item.owner.user = Some("u1".into());
            item.title = String::new();
            items.push(item);
        }
        let inputs: Vec<String> = items
            .iter()
            .map(|i| item_input(&i.title, &i.text))
            .collect();
        for (item, v) in items.iter_mut().zip(embedder.embed(&inputs).await.unwrap()) {
            assert_eq!(v.len(), 64);
            item.embedding = Some(v);
        }
        store.upsert_items(DEFAULT_TENANT, items).await.unwrap();
        let test = TestCtx::new().with_invocation(InvocationContext {
            data_source_id: Some("ds".into()),
            user: Some("u1".into()),
            ..InvocationContext::new("inv-h")
        });
        let query = json!({ "query": format!("silicosis {LONG}"), "topK": 2 });

        // BM25 alone cannot see the long word.
        let bm25 = Retrieval::new(Arc::new(store.clone()));
        let out = test
            .call(&RetrieveKnowledgeContext(bm25), query.clone())
            .await
            .unwrap();
        let ids: Vec<String> = out.data.unwrap()["hits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids, ["lexical"]);

        // Hybrid: both, by reciprocal rank.
        let hybrid = Retrieval::new(Arc::new(store.clone())).with_embedder(embedder.clone());
        let out = test
            .call(&RetrieveKnowledgeContext(hybrid), query.clone())
            .await
            .unwrap();
        let mut ids: Vec<String> = out.data.unwrap()["hits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        assert_eq!(ids, ["lexical", "semantic"]);

        // A dead endpoint: BM25 answers alone, no error.
        let dead = embedder_at("http://127.0.0.1:9/v1/".parse().unwrap());
        let fallback = Retrieval::new(Arc::new(store)).with_embedder(dead.clone());
        let out = test
            .call(&RetrieveKnowledgeContext(fallback), query)
            .await
            .unwrap();
        assert_eq!(out.data.unwrap()["hits"].as_array().unwrap().len(), 1);
        let e = dead.embed(&["x".into()]).await.unwrap_err();
        assert!(!e.to_string().contains("sk-embed-secret"), "{e}");
        assert!(!format!("{dead:?}").contains("sk-embed-secret"));
    }
}

/// The cross-tenant attack on every tool, for any backend: tenant globex
/// holds canary documents (a data source, a CSV, a user's private upload)
/// and canary context items of its user bob; tenant acme's job names
/// globex's data source, attaches globex's document ids and claims to be
/// bob. Nothing acme's tools return, cite or say in an error holds the
/// canary; the same calls as globex do find it (so the check can fail).
#[cfg(test)]
pub(crate) mod tenant_attack {
    use super::*;
    use crate::store::DocumentRecord;
    use toolfleet_worker::TestCtx;
    use toolfleet_worker::protocol::InvocationContext;

    pub(crate) const CANARY: &str = "zebracanary";
    const NOV2: i64 = 1_793_577_600_000;

    fn item(id: &str, kind: ItemKind, collection: &str, text: &str) -> Item {
        Item {
            id: id.into(),
            kind,
            collection: collection.into(),
            document_id: None,
            chunk: None,
            title: format!("Vault {id}"),
            text: text.into(),
            source: Some(format!("{id}.md")),
            owner: Owner {
                user: Some("bob".into()),
                ..Owner::default()
            },
            timestamp_ms: NOV2,
            ingested_ms: NOV2,
            entities: vec!["Vault Keeper".into()],
            level: None,
            child_ids: vec![],
            aliases: vec![],
            relations: vec![],
            embedding: None,
        }
    }

    async fn document(store: &dyn Store, tenant: &str, id: &str, text: &str, owner: Option<&str>) {
        let (collection, path) = id.split_once(':').unwrap();
        let mut chunk = item(&format!("{id}#0"), ItemKind::Document, collection, text);
        chunk.document_id = Some(id.into());
        chunk.chunk = Some(0);
        chunk.entities.clear();
        chunk.owner.user = owner.map(Into::into);
        let csv = path.ends_with(".csv");
        let record = DocumentRecord {
            id: id.into(),
            collection: collection.into(),
            title: path.into(),
            source: path.into(),
            format: if csv { "csv" } else { "markdown" }.into(),
            owner: chunk.owner.clone(),
            text: text.into(),
            raw: csv.then(|| text.to_owned()),
            timestamp_ms: NOV2,
            ingested_ms: NOV2,
            chunks: 1,
            tokens: 10,
        };
        store
            .replace_document(tenant, record, vec![chunk])
            .await
            .unwrap();
    }

    /// globex's canaries, and acme's own data under the same names.
    pub(crate) async fn seed(store: &dyn Store) {
        let secret = format!("The vault code is {CANARY}.");
        for (tenant, word) in [("globex", CANARY), ("acme", "acmeplain")] {
            let text = format!("The vault code is {word}.");
            document(store, tenant, "globex-kb:secret.md", &text, None).await;
            document(store, tenant, "uploads:bob.md", &text, Some("bob")).await;
        }
        document(
            store,
            "globex",
            "globex-kb:ledger.csv",
            &format!("vault,code\nmain,{CANARY}\n"),
            None,
        )
        .await;
        let mut items = vec![
            item("k-bob", ItemKind::Knowledge, "globex-kb", &secret),
            item("p-bob", ItemKind::Profile, "globex-kb", &secret),
        ];
        let mut entity = item("e-keeper", ItemKind::Entity, "globex-kb", &secret);
        entity.title = "Vault Keeper".into();
        items.push(entity);
        let mut l0 = item("ev-bob", ItemKind::Event, "globex-kb", &secret);
        l0.level = Some(Level::L0);
        let mut l1 = item("day-bob", ItemKind::Event, "globex-kb", &secret);
        l1.level = Some(Level::L1);
        l1.child_ids = vec!["ev-bob".into()];
        items.extend([l0, l1]);
        store.upsert_items("globex", items).await.unwrap();
    }

    fn as_tenant(tenant: &str) -> TestCtx {
        TestCtx::new().with_invocation(InvocationContext {
            tenant: Some(tenant.into()),
            user: Some("bob".into()),
            data_source_id: Some("globex-kb".into()),
            attached_documents: vec![
                "globex-kb:secret.md".into(),
                "globex-kb:ledger.csv".into(),
                "uploads:bob.md".into(),
            ],
            ..InvocationContext::new("inv-attack")
        })
    }

    /// Every tool's answers (content, data or error) as `tenant`, and the
    /// references they cited.
    async fn everything(r: &Retrieval, tenant: &str) -> String {
        let test = as_tenant(tenant);
        // The words are acme's too: an empty answer that echoes the query
        // must not count as a leak.
        let search = json!({ "query": "vault code", "topK": 10 });
        let mut out = Vec::new();
        let mut note = |result: Result<ToolOutput, ToolError>| match result {
            Ok(o) => out.push(format!("{}\n{}", o.content, o.data.unwrap_or_default())),
            Err(e) => out.push(e.to_string()),
        };
        note(test.call(&SearchDocuments(r.clone()), search.clone()).await);
        note(
            test.call(&SearchDataSources(r.clone()), search.clone())
                .await,
        );
        note(test.call(&ListDocuments(r.clone()), json!({})).await);
        for id in ["globex-kb:secret.md", "uploads:bob.md"] {
            note(
                test.call(&ReadDocument(r.clone()), json!({ "documentId": id }))
                    .await,
            );
        }
        let ledger = json!({ "documentId": "globex-kb:ledger.csv" });
        note(test.call(&ReadTabularData(r.clone()), ledger).await);
        note(
            test.call(&RetrieveKnowledgeContext(r.clone()), search.clone())
                .await,
        );
        let events = json!({ "query": "vault code", "from": "2026-11-01", "to": "2026-11-30" });
        note(test.call(&RetrieveEventContext(r.clone()), events).await);
        note(
            test.call(&RetrieveProfileContext(r.clone()), json!({ "query": "" }))
                .await,
        );
        for mode in ["exact", "similar", "list", "relationships"] {
            let lookup = json!({ "name": "Vault Keeper", "mode": mode });
            note(test.call(&EntityLookup(r.clone()), lookup).await);
        }
        for reference in test.references() {
            out.push(serde_json::to_string(&reference).unwrap());
        }
        out.join("\n")
    }

    /// Runs the attack on `store` (seeded here).
    pub(crate) async fn run(store: Arc<dyn Store>) {
        seed(store.as_ref()).await;
        let r = Retrieval::new(store.clone());
        let acme = everything(&r, "acme").await;
        assert!(
            !acme.contains(CANARY),
            "{} backend: acme got globex's canary:\n{acme}",
            store.backend()
        );
        assert!(acme.contains("acmeplain"), "acme finds its own:\n{acme}");
        // The positive control: the very same calls as globex find it by
        // every path (data source, attachment, table, bob's upload and
        // context items).
        let globex = everything(&r, "globex").await;
        assert!(
            globex.matches(CANARY).count() >= 10,
            "{} backend: globex's own calls should see the canary:\n{globex}",
            store.backend()
        );
    }
}
