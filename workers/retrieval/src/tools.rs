//! The retrieval tools over a [`Store`], each scoped by the call's headers
//! and never by what the model asks:
//!
//! - `document_processing` tools (`search_documents`, `list_documents`,
//!   `read_document`, `read_tabular_data`) see only the chat job's attached
//!   documents (`Toolfleet-Attached-Documents`).
//! - `search_data_sources` sees only the job's data source
//!   (`Toolfleet-Data-Source-Id`: the collection of that name).
//! - The context tools (`retrieve_knowledge_context`,
//!   `retrieve_event_context`, `retrieve_profile_context`, `entity_lookup`)
//!   see the job's data source and the job's user (`Toolfleet-User`), and
//!   may narrow further (device, agent, time, entities), never widen.
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
use crate::model::{Item, ItemKind, Level, Owner, normalize_entity};
use crate::normalize::{column_name, one_line, parse_csv};
use crate::search::{Hit, MAX_TOP_K, Query, TimeRange, merge_keep_best};
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
/// Bucket keys one event search filters on at most, per level.
const MAX_BUCKETS: usize = 400;

/// What every retrieval tool shares: the store and the family's metrics.
#[derive(Clone)]
pub struct Retrieval {
    store: Arc<dyn Store>,
    metrics: Option<RetrievalMetrics>,
}

impl Retrieval {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            metrics: None,
        }
    }

    /// Records search times in `metrics`.
    pub fn with_metrics(mut self, metrics: RetrievalMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    async fn search(&self, query: &Query) -> Result<Vec<Hit>, ToolError> {
        let started = Instant::now();
        let hits = self.store.search(query).await.map_err(store_error)?;
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
            documents,
            ..Self::default()
        })
    }

    /// The chat job's data source.
    pub fn data_source(ctx: &ToolCtx) -> Result<Self, ToolError> {
        match &ctx.invocation().data_source_id {
            Some(ds) => Ok(Self {
                collections: vec![ds.clone()],
                ..Self::default()
            }),
            None => Err(ToolError::invalid(
                "this chat has no data source to search; answer without one",
            )),
        }
    }

    /// The job's data source and user, narrowed by `narrow`'s device and
    /// agent. One of the two is required: without either, a context
    /// search would see everyone's items.
    pub fn context(ctx: &ToolCtx, narrow: &OwnerArgs) -> Result<Self, ToolError> {
        let invocation = ctx.invocation();
        if invocation.data_source_id.is_none() && invocation.user.is_none() {
            return Err(ToolError::blocked(
                "context retrieval needs the chat job's user or data source to scope it; \
                 this job names neither",
            ));
        }
        Ok(Self {
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
            text: text.to_owned(),
            collections: self.collections.clone(),
            documents: self.documents.clone(),
            owner: self.owner.clone(),
            top_k: top_k.clamp(1, MAX_TOP_K),
            ..Query::default()
        }
    }
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
            title: h.item.title.clone(),
            source: h.item.source.clone(),
            url: None,
            snippet: Some(cut(&one_line(&h.item.text), SNIPPET_MAX_CHARS)),
        })
        .collect();
    let cited = ctx.cite(refs).await?;
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
                h.item.title,
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
        let scope = Scope::attachments(ctx)?;
        let query = args
            .query(&self.0, &scope, vec![ItemKind::Document])
            .await?;
        let hits = self.0.search(&query).await?;
        let empty = format!(
            "Nothing in the attached documents matched {:?}.",
            args.query
        );
        cite_hits(ctx, &hits, true, empty).await
    }
}

/// `retrieval.search_data_sources`: the job's data source.
pub struct SearchDataSources(pub Retrieval);

impl Tool for SearchDataSources {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let scope = Scope::data_source(ctx)?;
        let query = args
            .query(
                &self.0,
                &scope,
                vec![ItemKind::Document, ItemKind::Knowledge],
            )
            .await?;
        let hits = self.0.search(&query).await?;
        let empty = format!("Nothing in the data source matched {:?}.", args.query);
        cite_hits(ctx, &hits, false, empty).await
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
        let docs = self
            .0
            .store
            .list_documents(&[], &scope.documents, limit)
            .await
            .map_err(store_error)?;
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
                "Attached but not (yet) in the index: {}",
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
        .document(id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ToolError::invalid(format!("attached document {id:?} is not in the index")))
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
        let cited = ctx
            .cite(vec![NewReference {
                kind: "document".into(),
                title: record.title.clone(),
                source: Some(record.source.clone()),
                url: None,
                snippet: Some(cut(&one_line(&text), SNIPPET_MAX_CHARS)),
            }])
            .await?;
        let marker = cited.first().map(|r| r.marker()).unwrap_or_default();
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
                "reference": cited.first().map(|r| r.index),
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
        let width = table
            .rows
            .iter()
            .map(Vec::len)
            .chain([table.header.len()])
            .max()
            .unwrap_or(0);
        let mut columns: Vec<usize> = if args.columns.is_empty() {
            (0..width).collect()
        } else {
            let mut picked = Vec::new();
            for wanted in &args.columns {
                let at = (0..width)
                    .find(|&i| column_name(&table.header, i).eq_ignore_ascii_case(wanted))
                    .ok_or_else(|| {
                        ToolError::invalid(format!(
                            "no column {wanted:?}; the columns are: {}",
                            (0..width)
                                .map(|i| column_name(&table.header, i))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                picked.push(at);
            }
            picked
        };
        let max_columns = args
            .max_columns
            .unwrap_or(TABLE_DEFAULT_COLUMNS)
            .clamp(1, TABLE_MAX_COLUMNS);
        let columns_cut = columns.len() > max_columns;
        columns.truncate(max_columns);
        let offset = args.offset.unwrap_or(0);
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
        let end = offset + rows.len();
        let cited = ctx
            .cite(vec![NewReference {
                kind: "document".into(),
                title: record.title.clone(),
                source: Some(record.source.clone()),
                url: None,
                snippet: Some(format!(
                    "rows {}–{} of {}",
                    offset + 1,
                    end,
                    table.rows.len()
                )),
            }])
            .await?;
        let marker = cited.first().map(|r| r.marker()).unwrap_or_default();
        let mut content = format!(
            "{marker} {} (rows {}–{end} of {}, {} of {width} columns):\n| {} |",
            record.title,
            (offset + 1).min(end.max(1)),
            table.rows.len(),
            names.len(),
            names.join(" | ")
        );
        for row in &rows {
            content.push_str(&format!("\n| {} |", row.join(" | ")));
        }
        if end < table.rows.len() {
            content.push_str(&format!("\n(more rows: call again with offset {end})"));
        }
        if columns_cut {
            content.push_str("\n(more columns: name the ones you need in columns)");
        }
        Ok(ToolOutput {
            content,
            data: Some(json!({
                "documentId": record.id,
                "reference": cited.first().map(|r| r.index),
                "columns": names,
                "rows": rows,
                "offset": offset,
                "totalRows": table.rows.len(),
                "raggedRows": table.ragged_rows,
            })),
        })
    }
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
        let lists = [
            self.0.search(&knowledge).await?,
            self.0.search(&events).await?,
        ];
        let hits = merge_keep_best(lists, args.top_k());
        let empty = format!("No knowledge matched {:?}.", args.query);
        cite_hits(ctx, &hits, false, empty).await
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
        let mut drilled: Vec<Hit> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut frontier: VecDeque<Hit> = self.0.search(&summaries).await?.into();
        while let Some(parent) = frontier.pop_front() {
            if !seen.insert(parent.item.id.clone()) {
                continue;
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
                    .search(&q)
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
        let direct = self.0.search(&direct).await?;
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
        cite_hits(ctx, &hits, false, empty).await
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
            EntityMode::Similar => {
                let wanted = normalize_entity(&args.name);
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
            EntityMode::List => {
                let mut query = scope.query(&args.name, top_k);
                query.kinds = vec![ItemKind::Entity];
                self.0.search(&query).await?
            }
            EntityMode::Relationships => {
                let Some((entity, _)) = best_entity(&candidates, &args.name) else {
                    return Ok(ToolOutput {
                        content: format!("No entity named {:?}.", args.name),
                        data: Some(json!({ "hits": [] })),
                    });
                };
                let me = normalize_entity(&entity.title);
                let mut related = vec![Hit {
                    item: entity.clone(),
                    score: 1.0,
                }];
                // Entities whose relations point at this one.
                let mut query = scope.query(&entity.title, MAX_TOP_K);
                query.kinds = vec![ItemKind::Entity];
                for hit in self.0.search(&query).await? {
                    if hit.item.id != entity.id
                        && hit
                            .item
                            .relations
                            .iter()
                            .any(|r| normalize_entity(&r.target) == me)
                    {
                        related.push(Hit {
                            item: hit.item,
                            score: 0.5,
                        });
                    }
                }
                related.truncate(top_k);
                related
            }
        };
        let mut output = cite_hits(
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
