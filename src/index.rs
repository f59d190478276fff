//! The document index from the command line: `toolfleet ingest` (files
//! into the index retrieval workers search), `toolfleet index search`
//! (the index searched as a retrieval tool would, to check an ingest) and
//! `toolfleet index migrate` (the PostgreSQL tables brought to this
//! release's schema, run as their owner before workers start).

use std::path::PathBuf;

use clap::Subcommand;

use crate::common::Output;
use crate::families::IndexArgs;

/// `toolfleet ingest`.
#[derive(clap::Args, Debug)]
pub struct IngestArgs {
    /// Files and directories (walked recursively): Markdown, HTML, plain
    /// text, CSV, and JSON Lines of context items.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// The data source (or upload collection) the documents belong to.
    #[arg(long)]
    pub collection: String,
    /// The tenant the documents belong to: only that tenant's jobs find
    /// them. Required when the index holds another tenant's data; else
    /// `default`.
    #[arg(long, env = "TOOLFLEET_TENANT")]
    pub tenant: Option<String>,
    /// Owner ids stored with every document.
    #[arg(long)]
    pub owner_user: Option<String>,
    #[arg(long)]
    pub owner_device: Option<String>,
    #[arg(long)]
    pub owner_agent: Option<String>,
    /// Only files under these directories are read (links resolved);
    /// default: the current directory.
    #[arg(long = "allow-root")]
    pub allow_roots: Vec<PathBuf>,
    /// Tokens per chunk (o200k_base).
    #[arg(long, default_value_t = toolfleet_worker_retrieval::chunk::DEFAULT_MAX_TOKENS)]
    pub chunk_tokens: usize,
    /// Tokens shared by consecutive chunks.
    #[arg(long, default_value_t = toolfleet_worker_retrieval::chunk::DEFAULT_OVERLAP_TOKENS)]
    pub chunk_overlap: usize,
    /// Larger files are skipped.
    #[arg(long, default_value_t = toolfleet_worker_retrieval::ingest::DEFAULT_MAX_FILE_BYTES)]
    pub max_file_bytes: u64,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub index: IndexArgs,
}

#[derive(Subcommand, Debug)]
pub enum IndexCommand {
    /// Search the index as a retrieval tool would (to check an ingest).
    Search {
        query: String,
        #[command(flatten)]
        index: IndexArgs,
        /// Only this data source or upload collection.
        #[arg(long)]
        collection: Option<String>,
        /// The tenant whose documents are searched (required when the
        /// index holds another tenant's data; else `default`).
        #[arg(long, env = "TOOLFLEET_TENANT")]
        tenant: Option<String>,
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        /// `text` (a passage per hit) or `json` (`[{"score", "id",
        /// "title", "collection", "text"}]`).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Create or upgrade the PostgreSQL tables of `--postgres-prefix` to
    /// this release's schema (versioned migrations, recorded in
    /// `<prefix>_schema_migrations`; a second run changes nothing). Run it
    /// as the tables' owner before starting workers: workers only check
    /// the version, so their role needs no DDL rights. A tantivy index
    /// needs none.
    Migrate {
        #[command(flatten)]
        index: IndexArgs,
        /// The dimensions of the `vector(N)` column (with pgvector), fixed
        /// when the column is made: the embedding model's. Default:
        /// --embeddings-dimensions, else the dimensions of a known
        /// --embeddings-model (text-embedding-3-small 1536,
        /// text-embedding-3-large 3072, text-embedding-ada-002 1536).
        #[arg(long, env = "TOOLFLEET_VECTOR_DIMENSIONS")]
        vector_dimensions: Option<usize>,
    },
}

/// `toolfleet index …`.
pub async fn run(command: IndexCommand) -> anyhow::Result<i32> {
    match command {
        IndexCommand::Migrate {
            index,
            vector_dimensions,
        } => migrate(&index, vector_dimensions).await,
        search @ IndexCommand::Search { .. } => self::search(search).await,
    }
}

/// `toolfleet index migrate`: exit 0 when the tables are current.
async fn migrate(index: &IndexArgs, vector_dimensions: Option<usize>) -> anyhow::Result<i32> {
    use toolfleet_worker_retrieval::Backend;
    use toolfleet_worker_retrieval::postgres_store::PostgresStore;
    if index.backend == Backend::Tantivy {
        println!("the tantivy index needs no migrations (it is opened as it is)");
        return Ok(0);
    }
    let url = index.postgres_url.as_deref().ok_or_else(|| {
        anyhow::anyhow!("--store postgres needs --postgres-url (or TOOLFLEET_POSTGRES_URL)")
    })?;
    let prefix = &index.postgres_prefix;
    let dimensions = vector_dimensions.or_else(|| {
        let asked = index
            .embeddings_dimensions
            .and_then(|d| usize::try_from(d).ok());
        asked.or(match index.embeddings_model.as_str() {
            "text-embedding-3-small" | "text-embedding-ada-002" => Some(1536),
            "text-embedding-3-large" => Some(3072),
            _ => None,
        })
    });
    let migrated = PostgresStore::migrate(url, prefix, dimensions).await?;
    for (version, description) in &migrated.applied {
        println!("applied {version}: {description}");
    }
    let vectors = match (&migrated.pgvector, migrated.dimensions) {
        (Some(v), Some(n)) => format!(
            "vectors of {n} dimensions searched with pgvector {v}, {}",
            if migrated.hnsw {
                "HNSW-indexed"
            } else {
                "without an HNSW index (exact scans)"
            }
        ),
        _ => "vectors scored by the workers (no pgvector, or no dimensions)".to_owned(),
    };
    println!(
        "the tables of prefix {prefix} are at schema version {} ({vectors})",
        migrated.version
    );
    Ok(0)
}

/// `toolfleet ingest`: exit 0 when every file went in, 2 when some input
/// was left out (the rest went in all the same).
pub async fn ingest(args: IngestArgs) -> anyhow::Result<i32> {
    let mut options = ingest_options(&args)?;
    let store = toolfleet_worker_retrieval::open_store(&args.index)
        .await
        .map_err(anyhow::Error::msg)?;
    options.tenant =
        toolfleet_worker_retrieval::ingest::resolve_tenant(store.as_ref(), args.tenant.as_deref())
            .await
            .map_err(anyhow::Error::msg)?;
    let (planned, _) = toolfleet_worker_retrieval::ingest::plan(&args.paths, &options);
    let total_bytes: u64 = planned.iter().map(|p| p.bytes).sum();
    let bar = progress_bar(total_bytes, args.quiet);
    let mut problems = Vec::new();
    let report = toolfleet_worker_retrieval::ingest::ingest(
        store.as_ref(),
        &args.paths,
        &options,
        &mut |file| {
            bar.inc(file.bytes);
            bar.set_message(file.path.display().to_string());
            note_problems(file, &mut problems);
        },
    )
    .await;
    bar.finish_and_clear();
    for problem in &problems {
        eprintln!("{problem}");
    }
    let mb = report.bytes_ingested() as f64 / 1_000_000.0;
    println!(
        "ingested {} documents ({} chunks) and {} context items into {:?} ({}) as tenant {:?} from {:.2} MB in {:.2} s ({:.2} MB/s); {} skipped",
        report.documents(),
        report.chunks(),
        report.items(),
        options.collection,
        store.backend(),
        options.tenant,
        mb,
        report.elapsed_secs,
        mb / report.elapsed_secs.max(1e-9),
        report.skipped()
    );
    // Some input left out is worth a non-zero exit for scripts; the rest
    // went in all the same.
    Ok(if report.skipped() == 0 { 0 } else { 2 })
}

/// The ingest's options from its flags, checked.
fn ingest_options(
    args: &IngestArgs,
) -> anyhow::Result<toolfleet_worker_retrieval::ingest::IngestOptions> {
    let chunking =
        toolfleet_worker_retrieval::chunk::ChunkConfig::new(args.chunk_tokens, args.chunk_overlap)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    let collection = args.collection.trim().to_owned();
    if collection.is_empty() || collection.chars().any(char::is_control) || collection.len() > 256 {
        anyhow::bail!("--collection must be 1-256 characters without control characters");
    }
    let allowed_roots = if args.allow_roots.is_empty() {
        vec![std::env::current_dir()?]
    } else {
        args.allow_roots.clone()
    };
    Ok(toolfleet_worker_retrieval::ingest::IngestOptions {
        // Chosen once the store is open (`resolve_tenant`).
        tenant: String::new(),
        collection,
        owner: toolfleet_worker_retrieval::model::Owner {
            user: args.owner_user.clone(),
            device: args.owner_device.clone(),
            agent: args.owner_agent.clone(),
        },
        chunking,
        max_file_bytes: args.max_file_bytes,
        allowed_roots,
        embedder: args.index.embedder().map_err(anyhow::Error::msg)?,
    })
}

/// A bar over the bytes to read, drawn only on a terminal and without
/// `--quiet`.
fn progress_bar(total_bytes: u64, quiet: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    let bar = if quiet || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(total_bytes)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {wide_msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// What went wrong or was left out of `file`, as lines for stderr (printed
/// once the bar is gone).
fn note_problems(
    file: &toolfleet_worker_retrieval::ingest::FileReport,
    problems: &mut Vec<String>,
) {
    use toolfleet_worker_retrieval::ingest::Outcome;
    match &file.outcome {
        Outcome::Skipped(why) => problems.push(format!("skipped {}: {why}", file.path.display())),
        Outcome::Document { warnings, .. } => problems.extend(
            warnings
                .iter()
                .map(|w| format!("warning {}: {w}", file.path.display())),
        ),
        Outcome::Items {
            written,
            rejected,
            stopped,
        } => {
            problems.extend(
                rejected.iter().map(|(line, why)| {
                    format!("skipped {} line {line}: {why}", file.path.display())
                }),
            );
            if let Some(why) = stopped {
                problems.push(format!(
                    "stopped {} after {written} items: {why}",
                    file.path.display()
                ));
            }
        }
    }
}

/// `toolfleet index search`: exit 0 (also when nothing matches).
async fn search(command: IndexCommand) -> anyhow::Result<i32> {
    let IndexCommand::Search {
        query,
        index,
        collection,
        tenant,
        top_k,
        output,
    } = command
    else {
        anyhow::bail!("not a search");
    };
    let store = toolfleet_worker_retrieval::open_store(&index)
        .await
        .map_err(anyhow::Error::msg)?;
    let tenant =
        toolfleet_worker_retrieval::ingest::resolve_tenant(store.as_ref(), tenant.as_deref())
            .await
            .map_err(anyhow::Error::msg)?;
    let query = toolfleet_worker_retrieval::search::Query {
        tenant,
        text: query,
        collections: collection.into_iter().collect(),
        top_k: top_k.clamp(1, toolfleet_worker_retrieval::search::MAX_TOP_K),
        ..Default::default()
    };
    let hits = store.search(&query).await?;
    if output == Output::Json {
        let rows: Vec<serde_json::Value> = hits
            .iter()
            .map(|h| {
                serde_json::json!({
                    "score": h.score,
                    "id": h.item.id,
                    "title": h.item.title,
                    "collection": h.item.collection,
                    "text": h.item.text,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    for h in &hits {
        let text: String = h.item.text.chars().take(200).collect();
        println!(
            "{:.3}  {}  {}\n       {}",
            h.score,
            h.item.id,
            h.item.title,
            text.replace('\n', " ")
        );
    }
    if hits.is_empty() {
        eprintln!("no match");
    }
    Ok(0)
}
