//! Ingestion: files in, documents and chunks into a [`Store`].
//!
//! Each path given is a file or a directory walked recursively (hidden
//! entries skipped, symbolic links followed only to places inside the
//! allowed roots). A file of a known format ([`Format`]) is read,
//! normalised, cut into chunks at paragraph and sentence boundaries
//! ([`chunk`]) and written with one [`Store::replace_document`] call, so
//! re-ingesting a file replaces its chunks atomically. A `.jsonl` file holds context items (knowledge,
//! events, entities, profiles), one JSON [`Item`] per line.
//!
//! Nothing about one file stops the others: a binary, huge, unreadable or
//! unparseable file, an invalid line, a path outside the allowed roots —
//! each is reported in the [`IngestReport`] and skipped.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::chunk::{ChunkConfig, chunk, count_tokens};
use crate::embed::{Embedder, item_input};
use crate::model::{Item, ItemKind, MAX_ID_CHARS, Owner};
use crate::normalize::{Format, normalize, one_line};
use crate::store::{DocumentRecord, Store, check_tenant};
use toolfleet_worker::protocol::DEFAULT_TENANT;

/// The default cap on one file's size.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Context items written per store call when reading JSON Lines.
const ITEM_BATCH: usize = 500;

/// What every ingested file shares.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// The tenant everything ingested belongs to (see [`resolve_tenant`]):
    /// only that tenant's jobs ever find it. A JSON Lines item cannot name
    /// another (an item has no tenant field).
    pub tenant: String,
    /// The data source or upload collection the documents belong to.
    pub collection: String,
    /// Who owns them.
    pub owner: Owner,
    /// How text is cut.
    pub chunking: ChunkConfig,
    /// Files larger than this are skipped.
    pub max_file_bytes: u64,
    /// Only files under these directories (after resolving links) are read.
    pub allowed_roots: Vec<PathBuf>,
    /// Embeds chunks and items (hybrid search) when set.
    pub embedder: Option<Embedder>,
}

/// What happened to one file.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A document went in.
    Document {
        /// Its id (`<collection>:<relative path>`).
        id: String,
        chunks: u32,
        tokens: u64,
        /// Things worth knowing that did not stop it (ragged CSV rows).
        warnings: Vec<String>,
    },
    /// Context items went in (a `.jsonl` file); `rejected` lines did not.
    Items {
        written: usize,
        /// Line number and reason of each line left out.
        rejected: Vec<(usize, String)>,
        /// Why the file stopped part-way (the store or the embeddings
        /// endpoint failed); the `written` items before it went in.
        stopped: Option<String>,
    },
    /// The file was left out, and why.
    Skipped(String),
}

/// One file's line in the report.
#[derive(Debug, Clone, PartialEq)]
pub struct FileReport {
    pub path: PathBuf,
    pub bytes: u64,
    pub outcome: Outcome,
}

/// The whole ingest.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IngestReport {
    pub files: Vec<FileReport>,
    pub elapsed_secs: f64,
}

impl IngestReport {
    /// Documents written.
    pub fn documents(&self) -> usize {
        self.files
            .iter()
            .filter(|f| matches!(f.outcome, Outcome::Document { .. }))
            .count()
    }

    /// Chunks written.
    pub fn chunks(&self) -> u64 {
        self.files
            .iter()
            .map(|f| match f.outcome {
                Outcome::Document { chunks, .. } => u64::from(chunks),
                _ => 0,
            })
            .sum()
    }

    /// Context items written.
    pub fn items(&self) -> usize {
        self.files
            .iter()
            .map(|f| match f.outcome {
                Outcome::Items { written, .. } => written,
                _ => 0,
            })
            .sum()
    }

    /// Files left out, wholly or in part.
    pub fn skipped(&self) -> usize {
        self.files
            .iter()
            .filter(|f| {
                matches!(
                    f.outcome,
                    Outcome::Skipped(_)
                        | Outcome::Items {
                            stopped: Some(_),
                            ..
                        }
                )
            })
            .count()
    }

    /// Bytes read from files that went in.
    pub fn bytes_ingested(&self) -> u64 {
        self.files
            .iter()
            .filter(|f| !matches!(f.outcome, Outcome::Skipped(_)))
            .map(|f| f.bytes)
            .sum()
    }
}

/// One file found under a root, with the root it is relative to.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub path: PathBuf,
    /// The path the document id and `source` use (relative to the argument
    /// it was found under; a file argument's own name).
    pub relative: String,
    pub bytes: u64,
}

/// The files the paths name, and the paths refused outright.
pub fn plan(paths: &[PathBuf], options: &IngestOptions) -> (Vec<Planned>, Vec<FileReport>) {
    let roots: Vec<PathBuf> = options
        .allowed_roots
        .iter()
        .filter_map(|r| r.canonicalize().ok())
        .collect();
    let mut planned = Vec::new();
    let mut refused = Vec::new();
    let skip = |path: &Path, reason: String| FileReport {
        path: path.to_path_buf(),
        bytes: 0,
        outcome: Outcome::Skipped(reason),
    };
    for arg in paths {
        let real = match arg.canonicalize() {
            Ok(real) => real,
            Err(e) => {
                refused.push(skip(arg, format!("cannot open: {e}")));
                continue;
            }
        };
        if !roots.iter().any(|root| real.starts_with(root)) {
            refused.push(skip(arg, outside(&options.allowed_roots)));
            continue;
        }
        if real.is_dir() {
            let mut found = Vec::new();
            walk(&real, &mut found, &mut refused, &roots, options);
            found.sort();
            for path in found {
                let relative = path
                    .strip_prefix(&real)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .replace('\\', "/");
                let bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                planned.push(Planned {
                    path,
                    relative,
                    bytes,
                });
            }
        } else {
            let relative = real
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let bytes = fs::metadata(&real).map(|m| m.len()).unwrap_or(0);
            planned.push(Planned {
                path: real,
                relative,
                bytes,
            });
        }
    }
    // Two files that would get one id (same relative path under two
    // arguments): the first goes in, the later ones are reported.
    let mut seen = std::collections::HashSet::new();
    let mut unique = Vec::with_capacity(planned.len());
    for file in planned {
        if seen.insert(file.relative.clone()) {
            unique.push(file);
        } else {
            refused.push(FileReport {
                path: file.path,
                bytes: file.bytes,
                outcome: Outcome::Skipped(format!(
                    "another file has the same path {:?} in this ingest, and so the same document id",
                    file.relative
                )),
            });
        }
    }
    (unique, refused)
}

fn outside(roots: &[PathBuf]) -> String {
    let roots: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    format!(
        "outside the allowed roots ({}); add one with --allow-root",
        roots.join(", ")
    )
}

fn walk(
    dir: &Path,
    found: &mut Vec<PathBuf>,
    refused: &mut Vec<FileReport>,
    roots: &[PathBuf],
    options: &IngestOptions,
) {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            refused.push(FileReport {
                path: dir.to_path_buf(),
                bytes: 0,
                outcome: Outcome::Skipped(format!("cannot read the directory: {e}")),
            });
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        // A link is followed only where it leads inside the roots, and a
        // directory reached twice (a link loop) is not walked again.
        let real = match path.canonicalize() {
            Ok(real) => real,
            Err(e) => {
                refused.push(FileReport {
                    path,
                    bytes: 0,
                    outcome: Outcome::Skipped(format!("cannot open: {e}")),
                });
                continue;
            }
        };
        if !roots.iter().any(|root| real.starts_with(root)) {
            refused.push(FileReport {
                path,
                bytes: 0,
                outcome: Outcome::Skipped(outside(&options.allowed_roots)),
            });
            continue;
        }
        if real.is_dir() {
            if real != path && dir.starts_with(&real) {
                continue;
            }
            walk(&path, found, refused, roots, options);
        } else if Format::of_path(&path).is_some() || is_jsonl(&path) {
            found.push(path);
        }
    }
}

fn is_jsonl(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

/// Reads, normalises and chunks one file into a document and its chunks,
/// without touching a store.
pub fn prepare(
    planned: &Planned,
    options: &IngestOptions,
    now_ms: i64,
) -> Result<(DocumentRecord, Vec<Item>, Vec<String>), String> {
    let format = Format::of_path(&planned.path).ok_or_else(|| {
        "not a format ingestion reads (Markdown, HTML, plain text, CSV, JSON Lines)".to_owned()
    })?;
    let bytes = read_capped(&planned.path, options.max_file_bytes)?;
    let timestamp_ms = modified_ms(&planned.path).unwrap_or(now_ms);
    let normalized = normalize(format, &bytes).map_err(|e| e.to_string())?;
    if normalized.text.is_empty() {
        return Err("no text in it".to_owned());
    }
    let id = format!("{}:{}", options.collection, planned.relative);
    if id.chars().count() > MAX_ID_CHARS - 12 {
        return Err(format!(
            "the document id would be longer than {} characters",
            MAX_ID_CHARS - 12
        ));
    }
    let title = normalized.title.clone().unwrap_or_else(|| {
        one_line(
            &Path::new(&planned.relative)
                .file_stem()
                .map(|s| s.to_string_lossy().replace(['_', '-'], " "))
                .unwrap_or_default(),
        )
    });
    let windows = chunk(&normalized.text, options.chunking);
    let tokens = count_tokens(&normalized.text) as u64;
    let chunks: Vec<Item> = windows
        .iter()
        .enumerate()
        .map(|(n, window)| Item {
            id: format!("{id}#{n}"),
            kind: ItemKind::Document,
            collection: options.collection.clone(),
            document_id: Some(id.clone()),
            chunk: Some(n as u32),
            title: title.clone(),
            text: normalized.text[window.bytes.clone()].to_owned(),
            source: Some(planned.relative.clone()),
            owner: options.owner.clone(),
            timestamp_ms,
            ingested_ms: now_ms,
            entities: Vec::new(),
            level: None,
            child_ids: Vec::new(),
            aliases: Vec::new(),
            relations: Vec::new(),
            embedding: None,
        })
        .collect();
    let raw = (format == Format::Csv).then(|| String::from_utf8_lossy(&bytes).into_owned());
    let record = DocumentRecord {
        id,
        collection: options.collection.clone(),
        title,
        source: planned.relative.clone(),
        format: format.as_str().to_owned(),
        owner: options.owner.clone(),
        text: normalized.text,
        raw,
        timestamp_ms,
        ingested_ms: now_ms,
        chunks: chunks.len() as u32,
        tokens,
    };
    Ok((record, chunks, normalized.warnings))
}

fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    let size = fs::metadata(path)
        .map_err(|e| format!("cannot read: {e}"))?
        .len();
    if size > max {
        return Err(format!("{size} bytes is over the {max}-byte limit"));
    }
    fs::read(path).map_err(|e| format!("cannot read: {e}"))
}

fn modified_ms(path: &Path) -> Option<i64> {
    let modified = fs::metadata(path).ok()?.modified().ok()?;
    let since = modified.duration_since(UNIX_EPOCH).ok()?;
    i64::try_from(since.as_millis()).ok()
}

/// Now, in Unix ms.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The tenant an ingest writes as: `named` (`--tenant`) when given, else
/// [`DEFAULT_TENANT`] — but only while the store holds no other tenant's
/// data, since a store of several tenants has no obvious one.
///
/// # Errors
///
/// A message for the operator: an invalid name, a store of other tenants
/// without `--tenant`, or the store's error.
pub async fn resolve_tenant(store: &dyn Store, named: Option<&str>) -> Result<String, String> {
    if let Some(tenant) = named {
        check_tenant(tenant).map_err(|e| format!("--tenant: {e}"))?;
        return Ok(tenant.to_owned());
    }
    let tenants = store.tenants().await.map_err(|e| e.to_string())?;
    let others: Vec<&str> = tenants
        .iter()
        .map(String::as_str)
        .filter(|t| *t != DEFAULT_TENANT)
        .collect();
    if others.is_empty() {
        Ok(DEFAULT_TENANT.to_owned())
    } else {
        Err(format!(
            "the index holds the data of tenants {}: name the tenant with --tenant \
             (what is ingested is found by that tenant's jobs alone)",
            tenants.join(", ")
        ))
    }
}

/// Sets the embedding of every item that has none.
async fn embed_items(embedder: Option<&Embedder>, items: &mut [Item]) -> Result<(), String> {
    let Some(embedder) = embedder else {
        return Ok(());
    };
    let missing: Vec<usize> = (0..items.len())
        .filter(|&i| items[i].embedding.is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let inputs: Vec<String> = missing
        .iter()
        .map(|&i| item_input(&items[i].title, &items[i].text))
        .collect();
    let vectors = embedder
        .embed(&inputs)
        .await
        .map_err(|e| format!("embedding failed: {e}"))?;
    for (i, vector) in missing.into_iter().zip(vectors) {
        items[i].embedding = Some(vector);
    }
    Ok(())
}

/// Reads a JSON Lines file of context items: every valid line is written
/// (in batches), every invalid one reported with its line number.
async fn ingest_items(
    store: &dyn Store,
    planned: &Planned,
    options: &IngestOptions,
    now: i64,
) -> Outcome {
    let bytes = match read_capped(&planned.path, options.max_file_bytes) {
        Ok(bytes) => bytes,
        Err(reason) => return Outcome::Skipped(reason),
    };
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Outcome::Skipped("binary content (not valid UTF-8)".to_owned());
    };
    let mut rejected = Vec::new();
    let mut batch = Vec::new();
    let mut written = 0;
    // A failure after some items went in still reports those.
    let stop = |written: usize, rejected: Vec<(usize, String)>, reason: String| {
        if written == 0 {
            Outcome::Skipped(reason)
        } else {
            Outcome::Items {
                written,
                rejected,
                stopped: Some(reason),
            }
        }
    };
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let item = serde_json::from_str::<Item>(line)
            .map_err(|e| e.to_string())
            .and_then(|mut item: Item| {
                if item.kind == ItemKind::Document {
                    return Err("document chunks come from files, not JSON Lines".to_owned());
                }
                if item.ingested_ms == 0 {
                    item.ingested_ms = now;
                }
                item.validate().map_err(|e| e.to_string())?;
                Ok(item)
            });
        match item {
            Ok(item) => batch.push(item),
            Err(reason) => rejected.push((n + 1, reason)),
        }
        if batch.len() == ITEM_BATCH {
            let count = batch.len();
            if let Err(e) = embed_items(options.embedder.as_ref(), &mut batch).await {
                return stop(written, rejected, e);
            }
            match store
                .upsert_items(&options.tenant, std::mem::take(&mut batch))
                .await
            {
                Ok(()) => written += count,
                Err(e) => return stop(written, rejected, e.to_string()),
            }
        }
    }
    if !batch.is_empty() {
        let count = batch.len();
        if let Err(e) = embed_items(options.embedder.as_ref(), &mut batch).await {
            return stop(written, rejected, e);
        }
        match store.upsert_items(&options.tenant, batch).await {
            Ok(()) => written += count,
            Err(e) => return stop(written, rejected, e.to_string()),
        }
    }
    Outcome::Items {
        written,
        rejected,
        stopped: None,
    }
}

/// Ingests `paths` into `store`, calling `progress` after every file.
pub async fn ingest(
    store: &dyn Store,
    paths: &[PathBuf],
    options: &IngestOptions,
    progress: &mut (dyn FnMut(&FileReport) + Send),
) -> IngestReport {
    let started = Instant::now();
    let (planned, refused) = plan(paths, options);
    let mut report = IngestReport::default();
    for file in refused {
        progress(&file);
        report.files.push(file);
    }
    let mut pending = Pending::default();
    for file in &planned {
        let now = now_ms();
        if is_jsonl(&file.path) {
            pending.flush(store, options, &mut report, progress).await;
            let outcome = ingest_items(store, file, options, now).await;
            report_file(&mut report, progress, file, outcome);
            continue;
        }
        let prepared = {
            let (file, options) = (file.clone(), options.clone());
            tokio::task::spawn_blocking(move || prepare(&file, &options, now))
                .await
                .unwrap_or_else(|e| Err(format!("failed while reading: {e}")))
        };
        let prepared = match prepared {
            Ok((record, mut chunks, warnings)) => {
                embed_items(options.embedder.as_ref(), &mut chunks)
                    .await
                    .map(|()| (record, chunks, warnings))
            }
            Err(e) => Err(e),
        };
        match prepared {
            Ok((record, chunks, warnings)) => {
                pending.bytes += file.bytes;
                pending
                    .documents
                    .push((file.clone(), record, chunks, warnings));
                if pending.bytes >= BATCH_BYTES || pending.documents.len() >= BATCH_DOCUMENTS {
                    pending.flush(store, options, &mut report, progress).await;
                }
            }
            Err(reason) => report_file(&mut report, progress, file, Outcome::Skipped(reason)),
        }
    }
    pending.flush(store, options, &mut report, progress).await;
    report.elapsed_secs = started.elapsed().as_secs_f64();
    report
}

/// Documents written per commit at most, and bytes of source files: a
/// commit (an fsync, a reader reload) costs far more than a document.
const BATCH_DOCUMENTS: usize = 64;
const BATCH_BYTES: u64 = 8 * 1024 * 1024;

fn report_file(
    report: &mut IngestReport,
    progress: &mut (dyn FnMut(&FileReport) + Send),
    file: &Planned,
    outcome: Outcome,
) {
    let line = FileReport {
        path: file.path.clone(),
        bytes: file.bytes,
        outcome,
    };
    progress(&line);
    report.files.push(line);
}

/// Prepared documents waiting for one commit.
#[derive(Default)]
struct Pending {
    documents: Vec<(Planned, DocumentRecord, Vec<Item>, Vec<String>)>,
    bytes: u64,
}

impl Pending {
    /// Writes the batch in one commit; if that fails, one document at a
    /// time, so the failure is reported against the file that caused it.
    async fn flush(
        &mut self,
        store: &dyn Store,
        options: &IngestOptions,
        report: &mut IngestReport,
        progress: &mut (dyn FnMut(&FileReport) + Send),
    ) {
        let documents = std::mem::take(&mut self.documents);
        self.bytes = 0;
        if documents.is_empty() {
            return;
        }
        let batch: Vec<(DocumentRecord, Vec<Item>)> = documents
            .iter()
            .map(|(_, record, chunks, _)| (record.clone(), chunks.clone()))
            .collect();
        let tenant = options.tenant.as_str();
        let together = store.replace_documents(tenant, batch).await;
        for (file, record, chunks, warnings) in documents {
            let written = match &together {
                Ok(()) => Ok(()),
                Err(_) => store.replace_document(tenant, record.clone(), chunks).await,
            };
            let outcome = match written {
                Ok(()) => Outcome::Document {
                    id: record.id,
                    chunks: record.chunks,
                    tokens: record.tokens,
                    warnings,
                },
                Err(e) => Outcome::Skipped(e.to_string()),
            };
            report_file(report, progress, &file, outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::Query;
    use crate::tantivy_store::TantivyStore;

    fn options(root: &Path) -> IngestOptions {
        IngestOptions {
            tenant: "acme".into(),
            collection: "handbook".into(),
            owner: Owner {
                user: Some("u1".into()),
                ..Owner::default()
            },
            chunking: ChunkConfig::new(40, 8).unwrap(),
            max_file_bytes: 64 * 1024,
            allowed_roots: vec![root.to_path_buf()],
            embedder: None,
        }
    }

    async fn search(store: &TantivyStore, text: &str) -> Vec<String> {
        let query = Query {
            tenant: "acme".into(),
            text: text.into(),
            top_k: 50,
            ..Query::default()
        };
        store
            .search(&query)
            .await
            .unwrap()
            .into_iter()
            .map(|h| h.item.id)
            .collect()
    }

    #[tokio::test]
    async fn bad_files_are_reported_and_skipped_and_the_rest_goes_in() {
        let root = tempfile::tempdir().unwrap();
        let docs = root.path().join("docs");
        fs::create_dir_all(docs.join("sub")).unwrap();
        fs::write(docs.join("guide.md"), "# Guide\n\nBeekeeping basics.\n").unwrap();
        fs::write(
            docs.join("sub/page.html"),
            "<title>Page</title><p>Hive <b>frames</p>",
        )
        .unwrap();
        fs::write(docs.join("notes.txt"), "plain notes about queens").unwrap();
        fs::write(docs.join("table.csv"), "a,b\n1,2\n3\n").unwrap();
        fs::write(docs.join("image.md"), b"\x89PNG\r\n\x1a\n\0\0binary").unwrap();
        fs::write(docs.join("huge.txt"), "x ".repeat(40_000)).unwrap();
        fs::write(docs.join("empty.md"), "<!-- nothing -->\n").unwrap();
        fs::write(docs.join("ignored.pdf"), "not read").unwrap();
        fs::write(docs.join(".hidden.md"), "hidden").unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("secret.md"), "secret").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret.md"), docs.join("link.md")).unwrap();
        fs::write(
            docs.join("facts.jsonl"),
            concat!(
                r#"{"id":"k1","kind":"knowledge","collection":"handbook","title":"Swarms","text":"swarms in spring","timestampMs":5}"#,
                "\n\nnot json\n",
                r#"{"id":"e1","kind":"event","collection":"handbook","title":"x","text":"y","timestampMs":5}"#,
                "\n"
            ),
        )
        .unwrap();

        let store_dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(store_dir.path()).unwrap();
        let mut seen = 0;
        let report = ingest(
            &store,
            &[
                docs.clone(),
                outside.path().join("secret.md"),
                root.path().join("missing"),
            ],
            &options(root.path()),
            &mut |_| seen += 1,
        )
        .await;
        assert_eq!(seen, report.files.len());
        let skipped: Vec<(String, String)> = report
            .files
            .iter()
            .filter_map(|f| match &f.outcome {
                Outcome::Skipped(why) => Some((
                    f.path.file_name().unwrap().to_string_lossy().into_owned(),
                    why.clone(),
                )),
                _ => None,
            })
            .collect();
        let why = |name: &str| {
            skipped
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, w)| w.as_str())
                .unwrap_or_else(|| panic!("{name} not skipped: {skipped:?}"))
        };
        assert!(why("image.md").contains("binary"), "{}", why("image.md"));
        assert!(why("huge.txt").contains("over the 65536-byte limit"));
        assert_eq!(why("empty.md"), "no text in it");
        assert!(why("secret.md").contains("outside the allowed roots"));
        assert!(why("link.md").contains("outside the allowed roots"));
        assert!(why("missing").contains("cannot open"));
        assert_eq!(skipped.len(), 6, "{skipped:?}");
        assert_eq!(report.documents(), 4);
        assert_eq!(report.items(), 1);
        let jsonl = report
            .files
            .iter()
            .find(|f| f.path.ends_with("facts.jsonl"))
            .unwrap();
        let Outcome::Items { rejected, .. } = &jsonl.outcome else {
            panic!("{jsonl:?}")
        };
        assert_eq!(rejected.len(), 2, "{rejected:?}");
        assert_eq!(rejected[0].0, 3);
        assert!(rejected[1].1.contains("needs a level"), "{rejected:?}");
        let csv = report
            .files
            .iter()
            .find(|f| f.path.ends_with("table.csv"))
            .unwrap();
        let Outcome::Document { warnings, .. } = &csv.outcome else {
            panic!()
        };
        assert_eq!(warnings.len(), 1);

        assert_eq!(search(&store, "frames").await, ["handbook:sub/page.html#0"]);
        assert_eq!(search(&store, "swarms").await, ["k1"]);
        assert!(search(&store, "secret").await.is_empty());
        let page = store
            .document("acme", "handbook:sub/page.html")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(page.title, "Page");
        assert_eq!(page.owner.user.as_deref(), Some("u1"));
        assert_eq!(page.text, "Hive frames");
        let table = store
            .document("acme", "handbook:table.csv")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(table.raw.as_deref(), Some("a,b\n1,2\n3\n"));
        let notes = store
            .document("acme", "handbook:notes.txt")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(notes.title, "notes");
    }

    #[tokio::test]
    async fn two_files_that_would_share_an_id_are_not_both_written() {
        let root = tempfile::tempdir().unwrap();
        for dir in ["a", "b"] {
            fs::create_dir_all(root.path().join(dir)).unwrap();
            fs::write(
                root.path().join(dir).join("README.md"),
                format!("# {dir}\n\nfrom {dir}"),
            )
            .unwrap();
        }
        let store_dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(store_dir.path()).unwrap();
        let report = ingest(
            &store,
            &[root.path().join("a"), root.path().join("b")],
            &options(root.path()),
            &mut |_| {},
        )
        .await;
        assert_eq!(report.documents(), 1);
        assert_eq!(report.skipped(), 1);
        let skipped = report
            .files
            .iter()
            .find(|f| matches!(f.outcome, Outcome::Skipped(_)))
            .unwrap();
        assert!(
            skipped
                .path
                .starts_with(root.path().join("b").canonicalize().unwrap()),
            "{skipped:?}"
        );
        let Outcome::Skipped(why) = &skipped.outcome else {
            unreachable!()
        };
        assert!(why.contains("same document id"), "{why}");
        let doc = store
            .document("acme", "handbook:README.md")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(doc.title, "a");
    }

    #[tokio::test]
    async fn re_ingesting_a_file_replaces_all_its_chunks() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("long.md");
        // The heading holds the word too: a paragraph too long to sit
        // beside it leaves the heading a chunk of its own.
        let document = |w: &str| format!("# Long {w}\n\n{}", format!("{w} ").repeat(400));
        fs::write(&file, document("alpha")).unwrap();
        let store_dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(store_dir.path()).unwrap();
        let options = options(root.path());
        let first = ingest(&store, std::slice::from_ref(&file), &options, &mut |_| {}).await;
        let Outcome::Document { chunks, .. } = first.files[0].outcome else {
            panic!("{first:?}")
        };
        assert!(chunks > 5, "{chunks}");
        assert_eq!(search(&store, "alpha").await.len(), chunks as usize);

        fs::write(&file, document("omega")).unwrap();
        ingest(&store, std::slice::from_ref(&file), &options, &mut |_| {}).await;
        assert!(search(&store, "alpha").await.is_empty());
        let omega = search(&store, "omega").await;
        assert_eq!(omega.len(), chunks as usize);
        assert!(omega.iter().all(|id| id.starts_with("handbook:long.md#")));
    }

    #[tokio::test]
    async fn files_go_to_the_named_tenant_which_a_store_of_several_requires() {
        let root = tempfile::tempdir().unwrap();
        fs::write(
            root.path().join("vault.md"),
            "# Vault\n\nThe vault code is 1234.",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = TantivyStore::open(dir.path()).unwrap();
        // An empty store: the default tenant, unless one is named.
        assert_eq!(resolve_tenant(&store, None).await.unwrap(), DEFAULT_TENANT);
        assert_eq!(resolve_tenant(&store, Some("acme")).await.unwrap(), "acme");
        let error = resolve_tenant(&store, Some("ac me")).await.unwrap_err();
        assert!(error.starts_with("--tenant: "), "{error}");

        let options = options(root.path());
        let report = ingest(&store, &[root.path().to_path_buf()], &options, &mut |_| {}).await;
        assert_eq!(report.documents(), 1);
        assert_eq!(search(&store, "vault").await, ["handbook:vault.md#0"]);
        let as_globex = Query {
            tenant: "globex".into(),
            text: "vault".into(),
            top_k: 10,
            ..Query::default()
        };
        assert!(store.search(&as_globex).await.unwrap().is_empty());
        assert!(
            store
                .document("globex", "handbook:vault.md")
                .await
                .unwrap()
                .is_none()
        );

        // The store now holds acme's: no tenant by default any more.
        let error = resolve_tenant(&store, None).await.unwrap_err();
        assert!(
            error.contains("tenants acme") && error.contains("--tenant"),
            "{error}"
        );
        assert_eq!(
            resolve_tenant(&store, Some("globex")).await.unwrap(),
            "globex"
        );
    }
}
