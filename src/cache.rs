//! `toolfleet cache purge TOOL [--tenant T]`: forgets a tool's cached
//! results (`docs/tool-cache.md`), of every tenant or of one.
//!
//! A purge is one `INCR` of the tool's generation in Redis
//! (`toolfleet_store::tool_cache`): every result stored before it stops
//! being given at once, on every orchestrator, and lapses with its TTL.
//! `TOOL` is `namespace:name` (every version), or a whole id whose version
//! is then ignored — results of a version are never kept apart from its
//! other versions' generation. A tenant's purge leaves the tool's
//! `global` results, which no tenant owns, alone. The command cannot know
//! every tool a fleet runs: a name no result was ever stored under (a
//! typo) is purged all the same, and the output says that nothing was
//! known to be cached under it.

use clap::{Args, Subcommand};

use crate::common::Output;

/// `toolfleet cache …`.
#[derive(Subcommand, Debug)]
pub enum CacheCommand {
    /// Forget a tool's cached results: every tenant's, or with --tenant
    /// that tenant's (its tenant- and user-scoped results). Exit 0 when
    /// done, 64 for a tool or tenant that is not a name.
    Purge(PurgeArgs),
}

/// `toolfleet cache purge`.
#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// The tool: `namespace:name`, or `namespace:name@x.y.z` (every
    /// version is purged all the same).
    pub tool: String,
    /// Only this tenant's results.
    #[arg(long)]
    pub tenant: Option<String>,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    #[command(flatten)]
    pub store: crate::keys::StoreArgs,
}

/// `toolfleet cache`: returns the exit code.
pub async fn run(command: CacheCommand) -> anyhow::Result<i32> {
    match command {
        CacheCommand::Purge(args) => purge(args).await,
    }
}

/// `namespace:name` of `tool` (`ns:name` or `ns:name@version`), or why not.
fn tool_name(tool: &str) -> Result<String, String> {
    let name = tool.split_once('@').map_or(tool, |(name, _)| name);
    let Some((ns, short)) = name.split_once(':') else {
        return Err(format!("{tool:?} is not namespace:name[@x.y.z]"));
    };
    if tool.contains('@') {
        tool.parse::<toolfleet_protocol::tools::ToolId>()
            .map_err(|e| format!("{tool:?}: {e}"))?;
    } else {
        toolfleet_protocol::tools::ToolId::new(ns, short, (0, 0, 0))
            .map_err(|e| format!("{tool:?}: {e}"))?;
    }
    Ok(name.to_owned())
}

async fn purge(args: PurgeArgs) -> anyhow::Result<i32> {
    const COMMAND: &str = "toolfleet cache purge";
    let tool = match tool_name(&args.tool) {
        Ok(tool) => tool,
        Err(e) => {
            eprintln!("{COMMAND}: {e}");
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
    };
    if let Some(t) = &args.tenant
        && !crate::common::tenant_ok(COMMAND, t)
    {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let store = args.store.connect().await?;
    let purged = store.cache_purge(&tool, args.tenant.as_deref()).await?;
    match args.output {
        Output::Text => {
            let whose = args
                .tenant
                .as_deref()
                .map_or("every tenant".to_owned(), |t| format!("tenant {t}"));
            println!(
                "purged the cached results of {tool} (every version) for {whose} (generation {})",
                purged.generation
            );
            if !purged.known {
                println!(
                    "note: nothing was known to be cached under {tool} for {whose}: no result of it was stored within the longest TTL (is the name right?)"
                );
            }
        }
        Output::Json => println!(
            "{}",
            serde_json::json!({
                "tool": tool,
                "tenant": args.tenant,
                "generation": purged.generation,
                "known": purged.known,
            })
        ),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_is_its_namespace_and_name() {
        assert_eq!(tool_name("units:convert").unwrap(), "units:convert");
        assert_eq!(tool_name("units:convert@1.2.3").unwrap(), "units:convert");
        for bad in [
            "units",
            "Units:convert",
            "units:convert@1",
            "units:con vert",
            "",
        ] {
            assert!(tool_name(bad).is_err(), "{bad:?}");
        }
    }
}
