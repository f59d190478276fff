//! `toolfleet tools`: list, show, search and validate tool definitions,
//! those of the definitions directory or (`--live`) those the running
//! fleet's workers serve.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use toolfleet_service::args::{NatsArgs, ToolDefsArgs};

use crate::common::Output;

#[derive(Subcommand, Debug)]
pub enum ToolsCommand {
    /// List the tools: those of the definitions directory (id, kind,
    /// purpose, category, title), or with `--live` those the running
    /// fleet's workers serve (id, live copies, worker families, delivery,
    /// kind); with `--live`, exits 1 when the fleet serves none.
    List {
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        /// Only tools of this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only tools whose id starts with this.
        #[arg(long)]
        id_prefix: Option<String>,
        /// Only tools with this tag.
        #[arg(long)]
        tag: Option<String>,
        /// Only tools of this category.
        #[arg(long)]
        category: Option<String>,
        #[command(flatten)]
        source: ToolsSource,
    },
    /// Show one tool's definition and its generated wire shapes.
    Show {
        /// Tool id (`namespace:name@x.y.z`) or function name.
        tool: String,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
    /// Search the tools of the definitions directory (or with `--live`
    /// those the running fleet serves): by name (exact 100, prefix 80,
    /// substring 60), tag (exact 50, substring 40) or description (20),
    /// best first; exits 1 when nothing matches.
    Search {
        /// What to look for (case does not matter).
        query: String,
        /// At most this many results.
        #[arg(long, default_value_t = toolfleet_protocol::search::DEFAULT_LIMIT)]
        limit: usize,
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        source: ToolsSource,
    },
    /// Validate tool definition files: every file of every directory given
    /// is checked and reported (not just up to the first broken one),
    /// duplicate ids and function names included; exits 1 when any is
    /// broken.
    Validate {
        /// Files or directories; the definitions directory when omitted.
        paths: Vec<PathBuf>,
        /// `text` (a line per file) or `json` (`[{"path", "ok", "id",
        /// "error"}]`).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
}

/// Where `tools list` and `tools search` read the tools from.
#[derive(Args, Debug)]
pub struct ToolsSource {
    /// Read the tools live workers of the running fleet serve (over NATS:
    /// `--nats-url`, `--subject-prefix`, …) instead of the definitions
    /// directory.
    #[arg(long)]
    pub live: bool,
    /// With `--live`: how long to collect the workers' answers, in ms.
    #[arg(long, default_value_t = 500, requires = "live")]
    pub wait_ms: u64,
    #[command(flatten)]
    pub defs: ToolDefsArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
}

/// `toolfleet tools …`; the exit code of the subcommand.
pub async fn run(command: ToolsCommand) -> anyhow::Result<i32> {
    match command {
        ToolsCommand::List {
            output,
            namespace,
            id_prefix,
            tag,
            category,
            source,
        } => {
            let filter = toolfleet_protocol::registry::Filter {
                namespace,
                id_prefix,
                tag,
                category,
                model: None,
            };
            list(&filter, output, &source).await
        }
        ToolsCommand::Show { tool, defs } => show(&tool, &defs),
        ToolsCommand::Search {
            query,
            limit,
            output,
            source,
        } => search(&query, limit, output, &source).await,
        ToolsCommand::Validate {
            paths,
            output,
            defs,
        } => validate(paths, output, defs),
    }
}

/// `tools list`: exit 1 when `--live` finds no tool.
async fn list(
    filter: &toolfleet_protocol::registry::Filter,
    output: Output,
    source: &ToolsSource,
) -> anyhow::Result<i32> {
    let registry = tools_registry(source).await?;
    let rows: Vec<serde_json::Value> = registry
        .find(filter)
        .into_iter()
        .map(|e| tool_row(e, source.live))
        .collect();
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Output::Text => print_tool_rows(&rows, source.live),
    }
    if source.live && registry.is_empty() {
        eprintln!("no live tools");
        return Ok(1);
    }
    Ok(0)
}

/// `tools show`: the definition and its two wire shapes.
fn show(tool: &str, defs: &ToolDefsArgs) -> anyhow::Result<i32> {
    let registry = crate::common::load_registry(&defs.dir)?;
    let def = match tool.parse::<toolfleet_protocol::tools::ToolId>() {
        Ok(id) => registry.get(&id),
        Err(_) => registry.by_function_name(tool),
    }
    .with_context(|| format!("no tool {tool:?} in {}", defs.dir.display()))?;
    println!("{}", serde_json::to_string_pretty(def)?);
    println!(
        "\nChat Completions shape:\n{}",
        serde_json::to_string_pretty(&def.chat_completions_tool())?
    );
    println!(
        "\nResponses shape:\n{}",
        serde_json::to_string_pretty(&def.responses_tool())?
    );
    Ok(0)
}

/// `tools search`: exit 1 when nothing matches.
async fn search(
    query: &str,
    limit: usize,
    output: Output,
    source: &ToolsSource,
) -> anyhow::Result<i32> {
    let registry = tools_registry(source).await?;
    if source.live && registry.is_empty() {
        eprintln!("no live tools");
    }
    let hits =
        toolfleet_protocol::search::search(registry.list().map(|e| e.definition()), query, limit);
    match output {
        Output::Json => {
            let rows: Vec<_> = hits
                .iter()
                .map(|h| {
                    let mut row = serde_json::json!({
                        "score": h.score,
                        "id": h.definition.id.to_string(),
                        "function": h.definition.function.name,
                        "title": h.definition.title,
                        "tags": h.definition.tags,
                    });
                    if source.live
                        && let Some(e) = registry.get_id(&h.definition.id)
                    {
                        row["workers"] = e.workers.into();
                        row["families"] = e.families.clone().into();
                    }
                    row
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&rows)?);
        }
        Output::Text => {
            for h in &hits {
                println!(
                    "{:>3}  {:<40} {:<20} {}",
                    h.score,
                    h.definition.id.to_string(),
                    h.definition.function.name,
                    h.definition.title
                );
            }
        }
    }
    Ok(if hits.is_empty() { 1 } else { 0 })
}

/// `tools validate`: every file of every path checked and reported; exit
/// 1 when any is broken.
fn validate(paths: Vec<PathBuf>, output: Output, defs: ToolDefsArgs) -> anyhow::Result<i32> {
    let paths = if paths.is_empty() {
        vec![defs.dir]
    } else {
        paths
    };
    let mut rows = Vec::new();
    for p in paths {
        let checked = if p.is_dir() {
            toolfleet_protocol::tools::validate_dir(&p).unwrap_or_else(|e| vec![(p, Err(e))])
        } else {
            let loaded = toolfleet_protocol::tools::load_file(&p);
            vec![(p, loaded)]
        };
        rows.extend(checked.into_iter().map(|(path, loaded)| match loaded {
            Ok(d) => serde_json::json!({
                "path": path.display().to_string(), "ok": true, "id": d.id.to_string(),
            }),
            Err(e) => serde_json::json!({
                "path": path.display().to_string(), "ok": false, "error": e.to_string(),
            }),
        }));
    }
    let bad = rows.iter().filter(|r| r["ok"] == false).count();
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Output::Text => {
            for r in &rows {
                let path = r["path"].as_str().unwrap_or_default();
                match r["id"].as_str() {
                    Some(id) => println!("ok   {path} ({id})"),
                    None => {
                        println!("FAIL {path}: {}", r["error"].as_str().unwrap_or_default())
                    }
                }
            }
            println!("{} file(s), {bad} broken", rows.len());
        }
    }
    Ok(if bad == 0 { 0 } else { 1 })
}

/// The tools `tools list` and `tools search` read: the definitions
/// directory, or with `--live` one reading of the fleet's catalog (what
/// its live workers serve), each through the registry.
async fn tools_registry(
    source: &ToolsSource,
) -> anyhow::Result<toolfleet_protocol::registry::Registry> {
    use toolfleet_protocol::catalog::{Catalog, discover};
    use toolfleet_protocol::registry::{DirSource, Registry};
    if source.live {
        let subjects = toolfleet_service::args::or_exit(source.nats.subjects().map_err(Into::into));
        let client = source.nats.connect("toolfleet-tools").await?;
        let catalog = discover(
            &client,
            &subjects,
            Duration::from_millis(source.wait_ms),
            &Catalog::default(),
        )
        .await?;
        Ok(Registry::build(&[&catalog]))
    } else {
        let dir = DirSource::load(&source.defs.dir).with_context(|| {
            format!(
                "loading tool definitions from {}",
                source.defs.dir.display()
            )
        })?;
        Ok(Registry::build(&[&dir]))
    }
}

/// One tool as `tools list` shows it: id, kind (`system` for a tool that
/// is not selectable), purpose, category, title, and for a live tool its
/// copies (`workers`), worker families and delivery.
fn tool_row(entry: &toolfleet_protocol::registry::RegistryEntry, live: bool) -> serde_json::Value {
    let d = entry.definition();
    let mut row = serde_json::json!({
        "id": d.id.to_string(),
        "kind": if d.selectable { "selectable" } else { "system" },
        "purpose": d.purpose(),
        "category": d.category,
        "title": d.title,
    });
    if live {
        row["workers"] = entry.workers.into();
        row["families"] = entry.families.clone().into();
        row["delivery"] = serde_json::to_value(d.delivery).unwrap_or_default();
    }
    row
}

/// The rows of [`tool_row`] as a table with a header.
fn print_tool_rows(rows: &[serde_json::Value], live: bool) {
    let text =
        |row: &serde_json::Value, key: &str| row[key].as_str().unwrap_or_default().to_owned();
    if live {
        println!(
            "{:<40} {:>7} {:<24} {:<9} KIND",
            "ID", "WORKERS", "FAMILIES", "DELIVERY"
        );
        for row in rows {
            let families: Vec<&str> = row["families"]
                .as_array()
                .map(|f| f.iter().filter_map(serde_json::Value::as_str).collect())
                .unwrap_or_default();
            println!(
                "{:<40} {:>7} {:<24} {:<9} {}",
                text(row, "id"),
                row["workers"],
                if families.is_empty() {
                    "-".to_owned()
                } else {
                    families.join(",")
                },
                text(row, "delivery"),
                text(row, "kind"),
            );
        }
    } else {
        println!(
            "{:<40} {:<10} {:<19} {:<12} TITLE",
            "ID", "KIND", "PURPOSE", "CATEGORY"
        );
        for row in rows {
            println!(
                "{:<40} {:<10} {:<19} {:<12} {}",
                text(row, "id"),
                text(row, "kind"),
                text(row, "purpose"),
                text(row, "category"),
                text(row, "title"),
            );
        }
    }
}
