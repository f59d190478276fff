//! The full-text document index behind retrieval tools.
//!
//! A [`DocumentIndex`] is a real search engine (tantivy) on disk. It is built
//! once from a directory of Markdown files ([`DocumentIndex::build`], run by
//! `toolfleet index build` or by a retrieval worker that finds no index at
//! start) and then opened read-only by every retrieval worker on the host
//! ([`DocumentIndex::open`]); the files are memory-mapped, so the workers
//! share one copy in the page cache.
//!
//! # What is indexed
//!
//! Each Markdown file is parsed with pulldown-cmark into plain text and split
//! into *passages*: a heading starts a new passage, and the paragraphs under
//! a heading are grouped into passages of about 100–200 words. One passage is
//! one tantivy document with the fields `doc_id`, `title`, `source`,
//! `section` and `text`, so a hit points at the passage that answers the
//! query, not only at the file. A search returns one hit per file (its best
//! passage), ordered by score.
//!
//! # Invariants
//!
//! - Nothing here writes to an index once it is built: a rebuild writes a new
//!   index beside the old one and swaps the directories, so a worker that has
//!   the old one open keeps reading it (its files stay mapped) until it
//!   reopens.
//! - User and model text is never query syntax: only words and
//!   double-quoted phrases survive (`AND`, `OR`, `NOT` become plain stop
//!   words), and what remains is parsed leniently, so no query text makes a
//!   search fail except one with no words at all.
//! - Indexing and searching use the same analyzer (registered under
//!   [`TOKENIZER`]), so the index, the query and the snippet chooser agree on
//!   what a word is.

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use serde::Serialize;
use tantivy::collector::TopDocs;
use tantivy::query::QueryParser;
use tantivy::schema::{
    Field, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions, Value,
};
use tantivy::tokenizer::{
    AsciiFoldingFilter, LowerCaser, RemoveLongFilter, SimpleTokenizer, StopWordFilter,
    TextAnalyzer, Token, TokenFilter, TokenStream, Tokenizer,
};
use tantivy::{
    Index, IndexReader, IndexWriter, ReloadPolicy, Searcher, TantivyDocument, TantivyError,
};

/// Name under which the index's analyzer is registered. Tokenizers are not
/// stored in the index, so [`DocumentIndex::build`] and
/// [`DocumentIndex::open`] both register it under this name.
pub const TOKENIZER: &str = "toolfleet_en";

/// A passage is closed once it holds at least this many words…
const PASSAGE_MIN_WORDS: usize = 100;
/// …and never grows past this many (a longer paragraph is cut at sentences).
const PASSAGE_MAX_WORDS: usize = 200;
/// Upper bound of a hit's snippet, in characters, ellipses included.
const SNIPPET_MAX_CHARS: usize = 400;
/// A word in the title says more about a document than the same word in its
/// body; a section heading sits between the two.
const TITLE_BOOST: f32 = 2.0;
const SECTION_BOOST: f32 = 1.5;
/// Indexing memory for the single writer thread (tantivy's floor is 15 MB).
/// One thread: a corpus of articles indexes in well under a second, and the
/// build often runs at worker start beside other processes.
const WRITER_MEMORY_BYTES: usize = 50_000_000;
/// Tokens longer than this are noise (base64, hashes) rather than words.
const MAX_TOKEN_BYTES: usize = 40;
/// The file that marks a directory as a tantivy index.
const META_FILE: &str = "meta.json";

/// Words too common to tell documents apart. Removing them matters for
/// question-shaped queries ("how do bees find flowers"), which is what models
/// and users send. Small on purpose: tantivy's own lists are behind a feature
/// this crate does not enable.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "can", "did", "do", "does", "for",
    "from", "had", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its", "me", "my",
    "no", "not", "of", "on", "or", "so", "such", "than", "that", "the", "their", "them", "then",
    "there", "these", "they", "this", "to", "was", "we", "were", "what", "when", "where", "which",
    "who", "why", "will", "with", "would", "you", "your",
];

const FIELD_DOC_ID: &str = "doc_id";
const FIELD_TITLE: &str = "title";
const FIELD_SOURCE: &str = "source";
const FIELD_SECTION: &str = "section";
const FIELD_TEXT: &str = "text";

/// One search result: a document and its best passage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SearchHit {
    /// Stable id: the path relative to the corpus, without extension and with
    /// `/` separators, e.g. `"lighthouses"` or `"guides/setup"`.
    pub doc_id: String,
    /// The document's first `#` heading, or its file stem when it has none.
    pub title: String,
    /// The path relative to the corpus, e.g. `"lighthouses.md"`.
    pub source: String,
    /// The heading of the best passage; `None` for text before any heading.
    pub section: Option<String>,
    /// The best passage as plain text, at most 400 characters, cut at word
    /// boundaries and marked with `…` where cut.
    pub snippet: String,
    /// BM25 score of the best passage (comparable within one search only).
    pub score: f32,
}

/// Size of an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    /// Markdown files indexed.
    pub documents: usize,
    /// Passages (tantivy documents) indexed.
    pub passages: usize,
}

/// What went wrong, for callers that decide by type (a worker answers an
/// empty query as the model's mistake, a missing index as an operator's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexErrorKind {
    /// There is no index at the given directory.
    Missing,
    /// The index was built with another schema or analyzer: rebuild it.
    Incompatible,
    /// The corpus directory is missing or holds no Markdown files.
    InvalidCorpus,
    /// The build target exists and is neither empty nor an index.
    InvalidTarget,
    /// The query has no words to search for.
    EmptyQuery,
    /// Reading or writing files failed.
    Io,
    /// The search engine reported an error.
    Engine,
}

/// Errors of building, opening and searching the document index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(
        "no document index at {}: run `toolfleet index build --corpus <DIR> --index {}` first",
        path.display(),
        path.display()
    )]
    Missing { path: PathBuf },
    #[error(
        "the document index at {} does not match this version of toolfleet ({reason}): rebuild it with `toolfleet index build`",
        path.display()
    )]
    Incompatible { path: PathBuf, reason: String },
    #[error("corpus directory {} does not exist or is not a directory", path.display())]
    CorpusMissing { path: PathBuf },
    #[error("no Markdown (*.md) files under corpus directory {}", path.display())]
    EmptyCorpus { path: PathBuf },
    #[error(
        "refusing to replace {}: it is neither empty nor a document index",
        path.display()
    )]
    TargetOccupied { path: PathBuf },
    #[error("empty query: give at least one word to search for")]
    EmptyQuery,
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("search engine error while {action}: {source}")]
    Engine {
        action: &'static str,
        #[source]
        source: TantivyError,
    },
}

impl IndexError {
    /// The kind of failure, for callers that branch on it.
    pub fn kind(&self) -> IndexErrorKind {
        match self {
            IndexError::Missing { .. } => IndexErrorKind::Missing,
            IndexError::Incompatible { .. } => IndexErrorKind::Incompatible,
            IndexError::CorpusMissing { .. } | IndexError::EmptyCorpus { .. } => {
                IndexErrorKind::InvalidCorpus
            }
            IndexError::TargetOccupied { .. } => IndexErrorKind::InvalidTarget,
            IndexError::EmptyQuery => IndexErrorKind::EmptyQuery,
            IndexError::Io { .. } => IndexErrorKind::Io,
            IndexError::Engine { .. } => IndexErrorKind::Engine,
        }
    }
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> IndexError {
    let path = path.to_path_buf();
    move |source| IndexError::Io {
        action,
        path,
        source,
    }
}

fn engine_error(action: &'static str) -> impl FnOnce(TantivyError) -> IndexError {
    move |source| IndexError::Engine { action, source }
}

/// A read-only, searchable document index. Cheap to clone (the state is
/// behind an `Arc`) and shared by every task of a worker. Searching is
/// synchronous and CPU-bound: async callers run it in `spawn_blocking`.
#[derive(Clone)]
pub struct DocumentIndex {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    reader: IndexReader,
    parser: QueryParser,
    analyzer: TextAnalyzer,
    fields: Fields,
    stats: IndexStats,
}

impl fmt::Debug for DocumentIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DocumentIndex")
            .field("path", &self.inner.path)
            .field("stats", &self.inner.stats)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct Fields {
    doc_id: Field,
    title: Field,
    source: Field,
    section: Field,
    text: Field,
}

impl DocumentIndex {
    /// Builds the index at `index_dir` from every `*.md` file under
    /// `corpus_dir` (recursively; hidden files and directories are skipped,
    /// symlinked directories are not followed), replacing any index already
    /// there.
    ///
    /// The new index is written to a temporary directory beside `index_dir`
    /// and swapped in by renames, so the parent of `index_dir` must be
    /// writable and on the same filesystem (mount a volume at the parent, not
    /// at the index directory itself). Processes that have the old index open
    /// keep a consistent view of it until they reopen. A target that exists
    /// and is neither empty nor an index is refused rather than deleted.
    pub fn build(corpus_dir: &Path, index_dir: &Path) -> Result<IndexStats, IndexError> {
        let documents = read_corpus(corpus_dir)?;
        if documents.is_empty() {
            return Err(IndexError::EmptyCorpus {
                path: corpus_dir.to_path_buf(),
            });
        }
        check_replaceable(index_dir)?;

        let parent = match index_dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(io_error("creating directory", &parent))?;
        let staging = tempfile::Builder::new()
            .prefix(".toolfleet-index-new-")
            .tempdir_in(&parent)
            .map_err(io_error("creating a staging directory in", &parent))?;

        let stats = write_index(staging.path(), &documents)?;
        // From here the staging directory is ours to move or clean up: the
        // guard must not delete it after a successful rename.
        let staged = staging.keep();
        if let Err(err) = swap_in(&staged, index_dir, &parent) {
            // Best effort: the error to report is the swap's, not this one's.
            let _ = fs::remove_dir_all(&staged);
            return Err(err);
        }
        tracing::info!(
            corpus = %corpus_dir.display(),
            index = %index_dir.display(),
            documents = stats.documents,
            passages = stats.passages,
            "document index built"
        );
        Ok(stats)
    }

    /// Opens the index at `index_dir` for searching. Nothing is written: the
    /// directory may be on a read-only mount shared by several workers.
    pub fn open(index_dir: &Path) -> Result<Self, IndexError> {
        if !index_dir.join(META_FILE).is_file() {
            return Err(IndexError::Missing {
                path: index_dir.to_path_buf(),
            });
        }
        let index = Index::open_in_dir(index_dir).map_err(engine_error("opening the index"))?;
        let (expected, fields) = schema();
        if index.schema() != expected {
            return Err(IndexError::Incompatible {
                path: index_dir.to_path_buf(),
                reason: "its fields differ from the expected schema".to_owned(),
            });
        }
        let analyzer = analyzer();
        index.tokenizers().register(TOKENIZER, analyzer.clone());
        // Manual reload: the files of a built index never change (a rebuild
        // swaps directories), so there is nothing to watch for.
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(engine_error("opening an index reader"))?;

        let mut parser =
            QueryParser::for_index(&index, vec![fields.title, fields.section, fields.text]);
        parser.set_field_boost(fields.title, TITLE_BOOST);
        parser.set_field_boost(fields.section, SECTION_BOOST);

        let stats = count(&reader.searcher(), fields.doc_id)?;
        tracing::debug!(
            index = %index_dir.display(),
            documents = stats.documents,
            passages = stats.passages,
            "document index opened"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                path: index_dir.to_path_buf(),
                reader,
                parser,
                analyzer,
                fields,
                stats,
            }),
        })
    }

    /// Searches for `query` and returns at most `limit` hits, one per
    /// document (its best passage), best first.
    ///
    /// Terms are OR-ed over title, section heading and text, with the title
    /// weighted most. Double-quoted phrases keep their meaning; every other
    /// query-syntax character is treated as a space and `AND`/`OR`/`NOT` as
    /// ordinary words, so any text is a valid query. A query without a single
    /// letter or digit is [`IndexError::EmptyQuery`]; one made only of stop
    /// words finds nothing.
    pub fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchHit>, IndexError> {
        let cleaned = sanitize_query(query);
        if !cleaned.chars().any(char::is_alphanumeric) {
            return Err(IndexError::EmptyQuery);
        }
        if limit == 0 {
            return Ok(Vec::new());
        }
        let inner = &*self.inner;
        let mut analyzer = inner.analyzer.clone();
        let query_terms = terms(&mut analyzer, &cleaned);
        if query_terms.is_empty() {
            // Only stop words. Tantivy reads a query with no positive clause
            // as "match everything", which is no answer to a question.
            return Ok(Vec::new());
        }
        let (parsed, errors) = inner.parser.parse_query_lenient(&cleaned);
        if !errors.is_empty() {
            // Leftovers such as a dangling `AND` are dropped by the lenient
            // parser; worth a trace when tuning, never an error.
            tracing::debug!(query = %cleaned, ?errors, "parts of the query were ignored");
        }

        let searcher = inner.reader.searcher();
        let total = usize::try_from(searcher.num_docs()).unwrap_or(usize::MAX);
        if total == 0 {
            return Ok(Vec::new());
        }

        // Passages of one document crowd each other out of the top N, so
        // fetch more than `limit` and widen until enough distinct documents
        // are found or every matching passage has been seen.
        let mut fetch = limit.saturating_mul(4).max(16).min(total);
        loop {
            let top = searcher
                .search(&parsed, &TopDocs::with_limit(fetch).order_by_score())
                .map_err(engine_error("searching"))?;
            let exhausted = top.len() < fetch || fetch >= total;
            let mut seen = HashSet::new();
            let mut hits = Vec::new();
            for (score, address) in top {
                let doc: TantivyDocument = searcher
                    .doc(address)
                    .map_err(engine_error("reading a stored passage"))?;
                let doc_id = stored(&doc, inner.fields.doc_id);
                if !seen.insert(doc_id.clone()) {
                    continue;
                }
                let text = stored(&doc, inner.fields.text);
                let section = Some(stored(&doc, inner.fields.section)).filter(|s| !s.is_empty());
                hits.push(SearchHit {
                    doc_id,
                    title: stored(&doc, inner.fields.title),
                    source: stored(&doc, inner.fields.source),
                    section,
                    snippet: snippet(&text, &query_terms, &mut analyzer),
                    score,
                });
                if hits.len() == limit {
                    break;
                }
            }
            if hits.len() == limit || exhausted {
                return Ok(hits);
            }
            fetch = fetch.saturating_mul(4).min(total);
        }
    }

    /// Documents and passages in the index, counted when it was opened.
    pub fn stats(&self) -> IndexStats {
        self.inner.stats
    }

    /// The directory the index was opened from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

/// The schema every index is built with. Identifier fields are stored
/// verbatim; the three searchable fields keep positions so quoted phrases
/// work.
fn schema() -> (Schema, Fields) {
    let searchable = TextOptions::default()
        .set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(TOKENIZER)
                .set_index_option(IndexRecordOption::WithFreqsAndPositions),
        )
        .set_stored();
    let mut builder = Schema::builder();
    let fields = Fields {
        doc_id: builder.add_text_field(FIELD_DOC_ID, STRING | STORED),
        title: builder.add_text_field(FIELD_TITLE, searchable.clone()),
        source: builder.add_text_field(FIELD_SOURCE, STRING | STORED),
        section: builder.add_text_field(FIELD_SECTION, searchable.clone()),
        text: builder.add_text_field(FIELD_TEXT, searchable),
    };
    (builder.build(), fields)
}

/// The analyzer of every searchable field and of queries: words split on
/// non-alphanumerics, lowercased, accents folded, stop words dropped, plurals
/// reduced to singular.
pub(crate) fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(AsciiFoldingFilter)
        .filter(StopWordFilter::remove(
            STOP_WORDS.iter().map(|word| (*word).to_owned()),
        ))
        .filter(PluralFilter)
        .build()
}

/// Writes a fresh index of `documents` into the empty directory `dir`.
fn write_index(dir: &Path, documents: &[SourceDocument]) -> Result<IndexStats, IndexError> {
    let (schema, fields) = schema();
    let index = Index::create_in_dir(dir, schema).map_err(engine_error("creating the index"))?;
    index.tokenizers().register(TOKENIZER, analyzer());
    let mut writer: IndexWriter = index
        .writer_with_num_threads(1, WRITER_MEMORY_BYTES)
        .map_err(engine_error("starting the index writer"))?;
    let mut passages = 0;
    for document in documents {
        for passage in &document.passages {
            let mut doc = TantivyDocument::default();
            doc.add_text(fields.doc_id, &document.doc_id);
            doc.add_text(fields.title, &document.title);
            doc.add_text(fields.source, &document.source);
            // An absent section is stored as "" and read back as `None`.
            doc.add_text(fields.section, passage.section.as_deref().unwrap_or(""));
            doc.add_text(fields.text, &passage.text);
            writer
                .add_document(doc)
                .map_err(engine_error("adding a passage"))?;
            passages += 1;
        }
    }
    writer
        .commit()
        .map_err(engine_error("committing the index"))?;
    // Merges run in background threads that write into `dir`: they must be
    // done before the directory is moved into place.
    writer
        .wait_merging_threads()
        .map_err(engine_error("finishing segment merges"))?;
    Ok(IndexStats {
        documents: documents.len(),
        passages,
    })
}

/// Refuses to build over a directory that holds something other than an
/// index, since building replaces the directory wholesale.
fn check_replaceable(index_dir: &Path) -> Result<(), IndexError> {
    match fs::symlink_metadata(index_dir) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(io_error("inspecting", index_dir)(err)),
        Ok(meta) if meta.is_dir() => {
            let mut entries =
                fs::read_dir(index_dir).map_err(io_error("reading directory", index_dir))?;
            if entries.next().is_none() || index_dir.join(META_FILE).is_file() {
                Ok(())
            } else {
                Err(IndexError::TargetOccupied {
                    path: index_dir.to_path_buf(),
                })
            }
        }
        Ok(_) => Err(IndexError::TargetOccupied {
            path: index_dir.to_path_buf(),
        }),
    }
}

/// Moves the finished index `staged` to `target`, retiring whatever was
/// there. Renames within one directory are atomic, so a reader opening
/// `target` sees the old index or the new one, except in the instant between
/// the two renames, where it sees none and gets [`IndexError::Missing`].
fn swap_in(staged: &Path, target: &Path, parent: &Path) -> Result<(), IndexError> {
    if !target.exists() {
        return fs::rename(staged, target).map_err(io_error("moving the new index to", target));
    }
    // An empty directory with a unique name: renaming a directory onto an
    // empty one replaces it (POSIX), which gives the old index a name that
    // no concurrent builder will pick.
    let retired = tempfile::Builder::new()
        .prefix(".toolfleet-index-old-")
        .tempdir_in(parent)
        .map_err(io_error("creating a directory in", parent))?
        .keep();
    if let Err(err) = fs::rename(target, &retired) {
        let _ = fs::remove_dir(&retired);
        return Err(io_error("moving the old index aside from", target)(err));
    }
    if let Err(err) = fs::rename(staged, target) {
        // Put the old index back so the host is no worse off than before.
        let _ = fs::rename(&retired, target);
        return Err(io_error("moving the new index to", target)(err));
    }
    if let Err(err) = fs::remove_dir_all(&retired) {
        tracing::warn!(path = %retired.display(), error = %err, "could not remove the old index");
    }
    Ok(())
}

/// Counts passages and distinct documents from the `doc_id` term dictionary,
/// so the numbers come from the index itself rather than a side file.
fn count(searcher: &Searcher, doc_id: Field) -> Result<IndexStats, IndexError> {
    let mut ids = HashSet::new();
    for segment in searcher.segment_readers() {
        let inverted = segment
            .inverted_index(doc_id)
            .map_err(engine_error("reading document ids"))?;
        let mut stream = inverted
            .terms()
            .stream()
            .map_err(|source| IndexError::Engine {
                action: "reading document ids",
                source: source.into(),
            })?;
        while stream.advance() {
            ids.insert(stream.key().to_vec());
        }
    }
    Ok(IndexStats {
        documents: ids.len(),
        passages: usize::try_from(searcher.num_docs()).unwrap_or(usize::MAX),
    })
}

fn stored(doc: &TantivyDocument, field: Field) -> String {
    doc.get_first(field)
        .and_then(|value| value.as_str())
        .unwrap_or_default()
        .to_owned()
}

// ---------------------------------------------------------------------------
// Corpus: Markdown files to passages.

/// A Markdown file ready to index.
#[derive(Debug)]
struct SourceDocument {
    doc_id: String,
    title: String,
    source: String,
    passages: Vec<Passage>,
}

#[derive(Debug, Clone, PartialEq)]
struct Passage {
    section: Option<String>,
    text: String,
}

/// Reads every Markdown file under `corpus_dir`, in path order so that a
/// build is deterministic.
fn read_corpus(corpus_dir: &Path) -> Result<Vec<SourceDocument>, IndexError> {
    if !corpus_dir.is_dir() {
        return Err(IndexError::CorpusMissing {
            path: corpus_dir.to_path_buf(),
        });
    }
    let mut files = Vec::new();
    collect_markdown(corpus_dir, &mut files)?;
    files.sort();
    files
        .iter()
        .map(|file| {
            let markdown =
                fs::read_to_string(file).map_err(io_error("reading Markdown file", file))?;
            let relative = file.strip_prefix(corpus_dir).unwrap_or(file);
            Ok(document(relative, &markdown))
        })
        .collect()
}

fn collect_markdown(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), IndexError> {
    for entry in fs::read_dir(dir).map_err(io_error("reading directory", dir))? {
        let entry = entry.map_err(io_error("reading directory", dir))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let file_type = entry.file_type().map_err(io_error("inspecting", &path))?;
        if file_type.is_dir() {
            collect_markdown(&path, out)?;
        } else if is_markdown(&path) && path.is_file() {
            // `is_file` follows a symlink to a file; a symlinked directory is
            // neither a dir entry nor a file here, so loops cannot happen.
            out.push(path);
        }
    }
    Ok(())
}

fn is_markdown(path: &Path) -> bool {
    path.extension()
        .is_some_and(|ext| ext.eq_ignore_ascii_case("md"))
}

/// Turns one Markdown file into a document: ids from its relative path, title
/// from its first `#` heading, passages from its sections.
fn document(relative: &Path, markdown: &str) -> SourceDocument {
    let parts: Vec<String> = relative
        .components()
        .filter_map(|component| match component {
            Component::Normal(part) => Some(part.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    let source = parts.join("/");
    let doc_id = match source.rsplit_once('.') {
        Some((stem, _)) if !stem.is_empty() && !stem.ends_with('/') => stem.to_owned(),
        _ => source.clone(),
    };
    let parsed = parse_markdown(markdown);
    let title = parsed.title.unwrap_or_else(|| {
        relative
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned())
            .unwrap_or_else(|| doc_id.clone())
    });
    let mut passages: Vec<Passage> = parsed
        .sections
        .iter()
        .flat_map(|section| {
            group_blocks(&section.blocks)
                .into_iter()
                .map(|text| Passage {
                    section: section.heading.clone(),
                    text,
                })
        })
        .collect();
    if passages.is_empty() {
        // A file with a title and no body is still findable by its title.
        passages.push(Passage {
            section: None,
            text: String::new(),
        });
    }
    SourceDocument {
        doc_id,
        title,
        source,
        passages,
    }
}

/// Markdown reduced to what a search needs: the title and, per section, its
/// heading and the plain text of its blocks (paragraphs, list items, code
/// blocks, table rows).
#[derive(Debug, Default, PartialEq)]
struct ParsedMarkdown {
    title: Option<String>,
    sections: Vec<Section>,
}

#[derive(Debug, Default, PartialEq)]
struct Section {
    heading: Option<String>,
    blocks: Vec<String>,
}

fn parse_markdown(markdown: &str) -> ParsedMarkdown {
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_YAML_STYLE_METADATA_BLOCKS;
    let mut parsed = ParsedMarkdown {
        title: None,
        sections: vec![Section::default()],
    };
    let mut buffer = String::new();
    let mut in_metadata = false;

    for event in Parser::new_ext(markdown, options) {
        match event {
            // Front matter is data about the file, not text to search.
            Event::Start(Tag::MetadataBlock(_)) => in_metadata = true,
            Event::End(TagEnd::MetadataBlock(_)) => in_metadata = false,
            _ if in_metadata => {}
            Event::Start(Tag::Heading { .. }) => flush_block(&mut buffer, &mut parsed),
            Event::End(TagEnd::Heading(level)) => {
                let heading = normalize_space(&buffer);
                buffer.clear();
                if level == HeadingLevel::H1 && parsed.title.is_none() {
                    parsed.title = Some(heading).filter(|h| !h.is_empty());
                } else if !heading.is_empty() {
                    parsed.sections.push(Section {
                        heading: Some(heading),
                        blocks: Vec::new(),
                    });
                }
            }
            // Cells of a row stay together; the row is the block.
            Event::End(TagEnd::TableCell) => buffer.push(' '),
            Event::Start(tag) if !is_inline(&tag) => flush_block(&mut buffer, &mut parsed),
            Event::End(tag) if !is_inline_end(&tag) => flush_block(&mut buffer, &mut parsed),
            Event::Text(text)
            | Event::Code(text)
            | Event::InlineMath(text)
            | Event::DisplayMath(text) => buffer.push_str(&text),
            Event::SoftBreak | Event::HardBreak => buffer.push(' '),
            // Raw HTML is markup, not prose; markers carry no words.
            Event::Start(_)
            | Event::End(_)
            | Event::Html(_)
            | Event::InlineHtml(_)
            | Event::FootnoteReference(_)
            | Event::TaskListMarker(_)
            | Event::Rule => {}
        }
    }
    flush_block(&mut buffer, &mut parsed);
    parsed
        .sections
        .retain(|section| section.heading.is_some() || !section.blocks.is_empty());
    parsed
}

fn is_inline(tag: &Tag<'_>) -> bool {
    matches!(
        tag,
        Tag::Emphasis
            | Tag::Strong
            | Tag::Strikethrough
            | Tag::Superscript
            | Tag::Subscript
            | Tag::Link { .. }
            | Tag::Image { .. }
            | Tag::TableCell
    )
}

fn is_inline_end(tag: &TagEnd) -> bool {
    matches!(
        tag,
        TagEnd::Emphasis
            | TagEnd::Strong
            | TagEnd::Strikethrough
            | TagEnd::Superscript
            | TagEnd::Subscript
            | TagEnd::Link
            | TagEnd::Image
            | TagEnd::TableCell
    )
}

fn flush_block(buffer: &mut String, parsed: &mut ParsedMarkdown) {
    let block = normalize_space(buffer);
    buffer.clear();
    if block.is_empty() {
        return;
    }
    if let Some(section) = parsed.sections.last_mut() {
        section.blocks.push(block);
    }
}

fn normalize_space(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Groups a section's blocks into passages: blocks are joined until a
/// passage reaches [`PASSAGE_MIN_WORDS`], a passage never exceeds
/// [`PASSAGE_MAX_WORDS`], and a block longer than that is cut at sentence
/// ends.
fn group_blocks(blocks: &[String]) -> Vec<String> {
    let mut passages = Vec::new();
    let mut current = String::new();
    let mut current_words = 0;
    for piece in blocks.iter().flat_map(|block| split_long(block)) {
        let words = piece.split_whitespace().count();
        if current_words > 0 && current_words + words > PASSAGE_MAX_WORDS {
            passages.push(std::mem::take(&mut current));
            current_words = 0;
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(&piece);
        current_words += words;
        if current_words >= PASSAGE_MIN_WORDS {
            passages.push(std::mem::take(&mut current));
            current_words = 0;
        }
    }
    if !current.is_empty() {
        passages.push(current);
    }
    passages
}

/// Cuts a block of more than [`PASSAGE_MAX_WORDS`] words into pieces of at
/// most that many, preferring the last sentence end after
/// [`PASSAGE_MIN_WORDS`].
fn split_long(block: &str) -> Vec<String> {
    let words: Vec<&str> = block.split_whitespace().collect();
    if words.len() <= PASSAGE_MAX_WORDS {
        return vec![block.to_owned()];
    }
    let mut pieces = Vec::new();
    let mut start = 0;
    while words.len() - start > PASSAGE_MAX_WORDS {
        let limit = start + PASSAGE_MAX_WORDS;
        let cut = (start + PASSAGE_MIN_WORDS..limit)
            .rev()
            .find(|&i| ends_sentence(words[i - 1]))
            .unwrap_or(limit);
        pieces.push(words[start..cut].join(" "));
        start = cut;
    }
    pieces.push(words[start..].join(" "));
    pieces
}

fn ends_sentence(word: &str) -> bool {
    word.trim_end_matches(['"', '\'', ')', ']', '\u{201d}', '\u{2019}'])
        .ends_with(['.', '!', '?'])
}

// ---------------------------------------------------------------------------
// Queries and snippets.

/// Keeps words, balanced double quotes (phrases) and nothing else, so that
/// no text a model or user writes is read as field names, ranges, boosts,
/// exclusions or wildcards. `AND`, `OR` and `NOT` are lowercased into plain
/// (stop) words: a model that writes "bees AND NOT wasps" means words, and a
/// purely negative query would otherwise match every document.
pub(crate) fn sanitize_query(raw: &str) -> String {
    let unified: String = raw
        .chars()
        .map(|c| match c {
            '\u{201c}' | '\u{201d}' | '\u{201e}' => '"',
            c => c,
        })
        .collect();
    let balanced = unified.matches('"').count().is_multiple_of(2);
    let kept: String = unified
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || (c == '"' && balanced) {
                c
            } else {
                ' '
            }
        })
        .collect();
    kept.split(' ')
        .map(|word| match word {
            "AND" | "OR" | "NOT" => word.to_ascii_lowercase(),
            _ => word.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The analyzed terms of `text`, as the index sees them.
pub(crate) fn terms(analyzer: &mut TextAnalyzer, text: &str) -> HashSet<String> {
    let mut stream = analyzer.token_stream(text);
    let mut out = HashSet::new();
    while stream.advance() {
        out.insert(stream.token().text.clone());
    }
    out
}

/// The part of a passage to show: the whole passage when it fits, otherwise
/// a window of at most [`SNIPPET_MAX_CHARS`] starting at the sentence that
/// holds the most query terms, cut at a word boundary.
fn snippet(text: &str, query_terms: &HashSet<String>, analyzer: &mut TextAnalyzer) -> String {
    if text.chars().count() <= SNIPPET_MAX_CHARS {
        return text.to_owned();
    }
    let starts = sentence_starts(text);
    let mut best = (0, 0);
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(text.len());
        let found = terms(analyzer, &text[start..end])
            .intersection(query_terms)
            .count();
        if found > best.1 {
            best = (i, found);
        }
    }
    // Start earlier when the best sentence is near the end, so the window is
    // full rather than a lone closing sentence.
    let mut first = best.0;
    while first > 0 && text[starts[first - 1]..].chars().count() <= SNIPPET_MAX_CHARS {
        first -= 1;
    }
    let start = starts[first];
    if start == 0 {
        truncate_words(text, SNIPPET_MAX_CHARS)
    } else {
        format!("…{}", truncate_words(&text[start..], SNIPPET_MAX_CHARS - 1))
    }
}

/// Byte offsets where sentences begin in whitespace-normalized text.
fn sentence_starts(text: &str) -> Vec<usize> {
    let mut starts = vec![0];
    let mut word_start = 0;
    for (i, c) in text.char_indices() {
        if c == ' ' {
            if ends_sentence(&text[word_start..i]) && i + 1 < text.len() {
                starts.push(i + 1);
            }
            word_start = i + 1;
        }
    }
    starts
}

/// `text` if it fits in `max_chars`, otherwise its longest prefix of whole
/// words that fits with a trailing `…`.
fn truncate_words(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let budget = max_chars.saturating_sub(1);
    let cut = text
        .char_indices()
        .nth(budget)
        .map_or(text.len(), |(i, _)| i);
    let head = &text[..cut];
    let head = if text[cut..].starts_with(' ') {
        head
    } else {
        // Mid-word: back up to the previous space, unless the passage is one
        // enormous word, which is cut where it is.
        head.rfind(' ').map_or(head, |space| &head[..space])
    };
    let head = head.trim_end_matches([' ', ',', ';', ':']);
    format!("{head}…")
}

// ---------------------------------------------------------------------------
// A light English plural stemmer (Harman's "S" stemmer).

/// Reduces English plurals to their singular (`bees` → `bee`, `colonies` →
/// `colony`), so a question about "flowers" finds a text about a "flower".
/// Deliberately light: a full stemmer is behind a tantivy feature this crate
/// does not enable, and plurals are most of the benefit. Indexing and
/// queries both run it, so its quirks (`lens` → `len`) cancel out.
#[derive(Clone)]
struct PluralFilter;

impl TokenFilter for PluralFilter {
    type Tokenizer<T: Tokenizer> = PluralFilterTokenizer<T>;

    fn transform<T: Tokenizer>(self, tokenizer: T) -> PluralFilterTokenizer<T> {
        PluralFilterTokenizer { inner: tokenizer }
    }
}

#[derive(Clone)]
struct PluralFilterTokenizer<T> {
    inner: T,
}

impl<T: Tokenizer> Tokenizer for PluralFilterTokenizer<T> {
    type TokenStream<'a> = PluralFilterStream<T::TokenStream<'a>>;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> Self::TokenStream<'a> {
        PluralFilterStream {
            tail: self.inner.token_stream(text),
        }
    }
}

struct PluralFilterStream<T> {
    tail: T,
}

impl<T: TokenStream> TokenStream for PluralFilterStream<T> {
    fn advance(&mut self) -> bool {
        if !self.tail.advance() {
            return false;
        }
        singularize(&mut self.tail.token_mut().text);
        true
    }

    fn token(&self) -> &Token {
        self.tail.token()
    }

    fn token_mut(&mut self) -> &mut Token {
        self.tail.token_mut()
    }
}

fn singularize(word: &mut String) {
    // Short words ("gas", "bus", "its") are rarely plurals; non-ASCII words
    // are left alone because the rules are English and byte-based.
    if word.len() <= 3 || !word.is_ascii() {
        return;
    }
    let len = word.len();
    if word.ends_with("ies") && !word.ends_with("eies") && !word.ends_with("aies") {
        word.truncate(len - 3);
        word.push('y');
    } else if word.ends_with('s') && !word.ends_with("us") && !word.ends_with("ss") {
        // Harman's "es" → "e" rule and its "s" → "" rule both drop the final
        // "s", so they are one branch here.
        word.truncate(len - 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED_CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/corpus");

    fn write(dir: &Path, relative: &str, content: &str) {
        let path = dir.join(relative);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    /// A small corpus with a nested file, a file without a title and a file
    /// with front matter.
    fn small_corpus() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "owls.md",
            "# Owls\n\nOwls hunt at night.\n\n## Hearing\n\nAn owl locates mice by sound alone, \
             using asymmetric ears.\n",
        );
        write(
            dir.path(),
            "guides/kettles.md",
            "---\nauthor: someone\n---\n# Kettles\n\n## Descaling\n\nVinegar dissolves the \
             limescale that hard water leaves in a kettle.\n",
        );
        write(
            dir.path(),
            "notes.md",
            "Plain notes about *glaciers* and [fjords](https://example.org).\n",
        );
        write(dir.path(), "ignored.txt", "glaciers glaciers glaciers");
        write(dir.path(), ".hidden/secret.md", "# Secret\n\nglaciers");
        dir
    }

    fn built(corpus: &Path) -> (tempfile::TempDir, DocumentIndex) {
        let root = tempfile::tempdir().unwrap();
        let index_dir = root.path().join("index");
        DocumentIndex::build(corpus, &index_dir).unwrap();
        let index = DocumentIndex::open(&index_dir).unwrap();
        (root, index)
    }

    #[test]
    fn builds_from_a_corpus_and_points_hits_at_documents_and_sections() {
        let corpus = small_corpus();
        let root = tempfile::tempdir().unwrap();
        let index_dir = root.path().join("index");
        let stats = DocumentIndex::build(corpus.path(), &index_dir).unwrap();
        assert_eq!(stats.documents, 3, "only visible *.md files are indexed");
        assert_eq!(stats.passages, 4);

        let index = DocumentIndex::open(&index_dir).unwrap();
        assert_eq!(index.stats(), stats, "open counts what build wrote");

        let hits = index
            .search("how do owls find mice in the dark", 5)
            .unwrap();
        assert_eq!(hits[0].doc_id, "owls");
        assert_eq!(hits[0].title, "Owls");
        assert_eq!(hits[0].source, "owls.md");
        assert_eq!(hits[0].section.as_deref(), Some("Hearing"));
        assert!(hits[0].snippet.contains("asymmetric ears"));

        let hits = index.search("limescale", 5).unwrap();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].doc_id, "guides/kettles");
        assert_eq!(hits[0].source, "guides/kettles.md");
        assert!(
            !hits[0].snippet.contains("author"),
            "front matter is not text"
        );

        let hits = index.search("glaciers", 5).unwrap();
        assert_eq!(hits.len(), 1, "hidden and non-Markdown files are skipped");
        assert_eq!(hits[0].title, "notes", "no heading: the file stem");
        assert_eq!(hits[0].section, None);
        assert_eq!(hits[0].snippet, "Plain notes about glaciers and fjords.");
    }

    #[test]
    fn shipped_corpus_answers_questions_about_each_article() {
        let (_root, index) = built(Path::new(SHIPPED_CORPUS));
        assert!(index.stats().documents >= 5);
        let cases = [
            ("how do bees find flowers", "honeybees"),
            ("waggle dance", "honeybees"),
            ("Pharos of Alexandria", "lighthouses"),
            ("Fresnel lens", "lighthouses"),
            ("fog signal warning ships", "lighthouses"),
            ("wild yeast and lactic acid bacteria", "sourdough"),
            ("how often should I feed my starter", "sourdough"),
            ("evaporation and condensation", "water-cycle"),
            ("how long does water stay in the ocean", "water-cycle"),
            ("borrow checker mutable references", "rust-ownership"),
            ("what is a lifetime", "rust-ownership"),
            ("why are there two high tides a day", "tides"),
        ];
        for (query, expected) in cases {
            let hits = index.search(query, 3).unwrap();
            let first = hits.first().map(|hit| hit.doc_id.as_str());
            assert_eq!(first, Some(expected), "query {query:?} gave {hits:#?}");
            for hit in &hits {
                assert!(!hit.snippet.is_empty());
                assert!(hit.snippet.chars().count() <= SNIPPET_MAX_CHARS);
                assert!(hit.score > 0.0);
            }
        }
    }

    #[test]
    fn one_hit_per_document_best_first_within_limit() {
        let (_root, index) = built(Path::new(SHIPPED_CORPUS));
        // A word every article uses many times over.
        let hits = index.search("water light time", 10).unwrap();
        let ids: HashSet<_> = hits.iter().map(|hit| hit.doc_id.clone()).collect();
        assert_eq!(ids.len(), hits.len(), "one hit per document: {hits:#?}");
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));

        let hits = index.search("water light time", 2).unwrap();
        assert_eq!(hits.len(), 2);
        assert!(index.search("water", 0).unwrap().is_empty());
    }

    #[test]
    fn title_words_outrank_a_passing_mention() {
        let corpus = tempfile::tempdir().unwrap();
        write(
            corpus.path(),
            "comets.md",
            "# Comets\n\nIcy bodies with long orbits that grow tails near the sun.\n",
        );
        write(
            corpus.path(),
            "telescopes.md",
            "# Telescopes\n\nAmateurs point them at planets, nebulae and the odd comet.\n",
        );
        let (_root, index) = built(corpus.path());
        let hits = index.search("comet", 2).unwrap();
        assert_eq!(hits[0].doc_id, "comets", "{hits:#?}");
    }

    #[test]
    fn quoted_phrases_match_words_in_order() {
        let corpus = tempfile::tempdir().unwrap();
        write(corpus.path(), "a.md", "# A\n\nThe red kite soars.\n");
        write(
            corpus.path(),
            "b.md",
            "# B\n\nA kite, painted red, soars.\n",
        );
        let (_root, index) = built(corpus.path());
        let hits = index.search("\"red kite\"", 5).unwrap();
        let ids: Vec<_> = hits.iter().map(|hit| hit.doc_id.as_str()).collect();
        assert_eq!(ids, ["a"]);
    }

    #[test]
    fn odd_query_text_never_errors() {
        let (_root, index) = built(Path::new(SHIPPED_CORPUS));
        let queries = [
            "\"unbalanced quote about bees",
            "title: (bees",
            "bees AND",
            "AND",
            "NOT",
            "OR OR AND bees",
            "a:b:c ((( ))) lighthouse",
            "\"\" bees",
            "[1 TO 5] {x} tides",
            "-bees +flowers^2 ~ * ? \\",
            "what's the Pharos? (the one in Alexandria)",
            "source:lighthouses.md doc_id:honeybees",
            "“curly quotes” and ‘single’ ones",
            "rust's `&mut T` vs &T",
            "日本語のクエリ",
        ];
        for query in queries {
            if let Err(err) = index.search(query, 5) {
                panic!("query {query:?} failed: {err}");
            }
        }
        let hits = index
            .search("what's the Pharos? (the one in Alexandria)", 1)
            .unwrap();
        assert_eq!(hits[0].doc_id, "lighthouses");
    }

    #[test]
    fn a_query_without_words_is_an_error() {
        let corpus = small_corpus();
        let (_root, index) = built(corpus.path());
        for query in ["", "   ", "?!: ()", "\"\""] {
            let err = index.search(query, 5).unwrap_err();
            assert_eq!(err.kind(), IndexErrorKind::EmptyQuery, "{query:?}");
        }
        // Only stop words: a valid query that finds nothing.
        let hits = index.search("how do the", 5).unwrap();
        assert!(hits.is_empty(), "{hits:#?}");
        // A purely negative query is words, not "everything but owls".
        let hits = index.search("NOT owls", 5).unwrap();
        let ids: Vec<_> = hits.iter().map(|hit| hit.doc_id.as_str()).collect();
        assert_eq!(ids, ["owls"]);
    }

    #[test]
    fn opening_a_missing_index_says_how_to_build_one() {
        let root = tempfile::tempdir().unwrap();
        for dir in [root.path().join("absent"), root.path().to_path_buf()] {
            let err = DocumentIndex::open(&dir).unwrap_err();
            assert_eq!(err.kind(), IndexErrorKind::Missing);
            let message = err.to_string();
            assert!(message.contains("toolfleet index build"), "{message}");
            assert!(message.contains(&dir.display().to_string()), "{message}");
        }
    }

    #[test]
    fn opening_an_index_of_another_schema_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let mut builder = Schema::builder();
        builder.add_text_field("body", tantivy::schema::TEXT);
        Index::create_in_dir(root.path(), builder.build()).unwrap();
        let err = DocumentIndex::open(root.path()).unwrap_err();
        assert_eq!(err.kind(), IndexErrorKind::Incompatible);
        assert!(err.to_string().contains("rebuild"));
    }

    #[test]
    fn rebuild_replaces_the_index_and_open_readers_keep_working() {
        let root = tempfile::tempdir().unwrap();
        let index_dir = root.path().join("index");
        let first = tempfile::tempdir().unwrap();
        write(
            first.path(),
            "alpha.md",
            "# Alpha\n\nAardvarks dig burrows.\n",
        );
        write(first.path(), "beta.md", "# Beta\n\nBadgers dig setts.\n");
        DocumentIndex::build(first.path(), &index_dir).unwrap();
        let old = DocumentIndex::open(&index_dir).unwrap();

        let second = tempfile::tempdir().unwrap();
        write(
            second.path(),
            "gamma.md",
            "# Gamma\n\nGazelles outrun cheetahs.\n",
        );
        let stats = DocumentIndex::build(second.path(), &index_dir).unwrap();
        assert_eq!(stats.documents, 1);

        let new = DocumentIndex::open(&index_dir).unwrap();
        assert_eq!(new.stats().documents, 1);
        assert!(new.search("aardvarks", 5).unwrap().is_empty());
        assert_eq!(new.search("gazelles", 5).unwrap()[0].doc_id, "gamma");

        // A worker that opened the old index before the rebuild still reads
        // it consistently.
        assert_eq!(old.search("aardvarks", 5).unwrap()[0].doc_id, "alpha");

        // Nothing is left beside the index: no staging or retired copies.
        let leftovers: Vec<_> = fs::read_dir(root.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, ["index"]);
    }

    #[test]
    fn build_refuses_to_replace_a_directory_that_is_not_an_index() {
        let corpus = small_corpus();
        let target = tempfile::tempdir().unwrap();
        write(target.path(), "thesis.tex", "irreplaceable");
        let err = DocumentIndex::build(corpus.path(), target.path()).unwrap_err();
        assert_eq!(err.kind(), IndexErrorKind::InvalidTarget);
        assert!(target.path().join("thesis.tex").is_file());

        // An empty directory is fine.
        let empty = tempfile::tempdir().unwrap();
        DocumentIndex::build(corpus.path(), empty.path()).unwrap();
        DocumentIndex::open(empty.path()).unwrap();
    }

    #[test]
    fn build_rejects_a_missing_or_empty_corpus() {
        let root = tempfile::tempdir().unwrap();
        let index_dir = root.path().join("index");
        let err = DocumentIndex::build(&root.path().join("nope"), &index_dir).unwrap_err();
        assert_eq!(err.kind(), IndexErrorKind::InvalidCorpus);

        let empty = tempfile::tempdir().unwrap();
        write(empty.path(), "readme.txt", "not markdown");
        let err = DocumentIndex::build(empty.path(), &index_dir).unwrap_err();
        assert_eq!(err.kind(), IndexErrorKind::InvalidCorpus);
        assert!(!index_dir.exists());
    }

    #[test]
    fn index_is_shareable_across_threads() {
        fn assert_shareable<T: Send + Sync + Clone + 'static>() {}
        assert_shareable::<DocumentIndex>();

        let (_root, index) = built(Path::new(SHIPPED_CORPUS));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let index = index.clone();
                std::thread::spawn(move || index.search("waggle dance", 1).unwrap())
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.join().unwrap()[0].doc_id, "honeybees");
        }
    }

    #[test]
    fn markdown_becomes_plain_text_per_section() {
        let parsed = parse_markdown(
            "---\ntitle: x\n---\n\nIntro with `code` and a [link](http://x).\n\n\
             # The Title\n\n## First\n\n- one\n- two *emph*\n\n```rust\nlet x = 1;\n```\n\n\
             | a | b |\n|---|---|\n| c | d |\n\n<div>html</div>\n\n## Second\n\nLast.\n",
        );
        assert_eq!(parsed.title.as_deref(), Some("The Title"));
        assert_eq!(
            parsed.sections,
            [
                Section {
                    heading: None,
                    blocks: vec!["Intro with code and a link.".to_owned()],
                },
                Section {
                    heading: Some("First".to_owned()),
                    blocks: vec![
                        "one".to_owned(),
                        "two emph".to_owned(),
                        "let x = 1;".to_owned(),
                        "a b".to_owned(),
                        "c d".to_owned(),
                    ],
                },
                Section {
                    heading: Some("Second".to_owned()),
                    blocks: vec!["Last.".to_owned()],
                },
            ]
        );
    }

    #[test]
    fn passages_hold_about_one_to_two_hundred_words() {
        let sentence = "Bees dance to tell their sisters where the flowers are.";
        let short = [sentence; 3].join(" "); // 30 words
        let long = [sentence; 50].join(" "); // 500 words
        let passages = group_blocks(&[short.clone(), short.clone(), long, short.clone()]);
        let counts: Vec<usize> = passages
            .iter()
            .map(|p| p.split_whitespace().count())
            .collect();
        assert!(counts.iter().all(|&n| n <= PASSAGE_MAX_WORDS), "{counts:?}");
        assert!(counts.iter().sum::<usize>() == 30 * 3 + 500);
        for passage in &passages {
            assert!(passage.ends_with('.'), "cut at sentence ends: {passage}");
        }
        // Short blocks are grouped rather than indexed one by one.
        assert_eq!(
            group_blocks(&[short.clone(), short.clone()]),
            [format!("{short} {short}")]
        );
    }

    #[test]
    fn snippets_fit_and_start_at_the_best_sentence() {
        let mut analyzer = analyzer();
        let filler = "Nothing of interest happens in this sentence at all. ".repeat(12);
        let text = format!("{filler}Bees read polarised light to find the sun. {filler}");
        let text = normalize_space(&text);
        let query = terms(&mut analyzer, "polarised light");
        let snip = snippet(&text, &query, &mut analyzer);
        assert!(snip.chars().count() <= SNIPPET_MAX_CHARS, "{snip}");
        assert!(snip.starts_with("…Bees read polarised light"), "{snip}");
        assert!(snip.ends_with('…'));
        assert!(!snip.contains("  "));
        let body = snip.trim_matches('…');
        assert!(text.contains(body), "cut at word boundaries: {snip}");

        // No query term in the text (matched on the title): the beginning.
        let none = snippet(&text, &terms(&mut analyzer, "zebra"), &mut analyzer);
        assert!(none.starts_with("Nothing of interest"));
    }

    #[test]
    fn truncation_cuts_at_word_boundaries() {
        assert_eq!(truncate_words("short", 10), "short");
        assert_eq!(truncate_words("alpha beta gamma", 12), "alpha beta…");
        assert_eq!(truncate_words("alpha, beta gamma", 9), "alpha…");
        assert_eq!(truncate_words("abcdefghijkl", 5), "abcd…");
    }

    #[test]
    fn query_syntax_is_neutralised() {
        assert_eq!(sanitize_query("title:(bees)"), "title  bees ");
        assert_eq!(sanitize_query("\"red kite\" -x"), "\"red kite\"  x");
        assert_eq!(sanitize_query("\"odd"), " odd");
        assert_eq!(sanitize_query("“curly”"), "\"curly\"");
        assert_eq!(sanitize_query("bees AND NOT wasps"), "bees and not wasps");
    }

    #[test]
    fn plurals_become_singular() {
        let cases = [
            ("bees", "bee"),
            ("flowers", "flower"),
            ("colonies", "colony"),
            ("boxes", "boxe"),
            ("glass", "glass"),
            ("virus", "virus"),
            ("gas", "gas"),
            ("canoes", "canoe"),
        ];
        for (word, expected) in cases {
            let mut word = word.to_owned();
            singularize(&mut word);
            assert_eq!(word, expected);
        }
        let mut analyzer = analyzer();
        let found = terms(&mut analyzer, "How do the Bees find FLOWERS");
        assert_eq!(
            found,
            HashSet::from(["bee".to_owned(), "find".to_owned(), "flower".to_owned()])
        );
    }
}
