//! `toolfleet blob get`: the binary outputs of tools (images, files),
//! read from the store.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BlobCommand {
    /// Write a blob's bytes to FILE (or to stdout when it is not a
    /// terminal). Exits 1 when the blob is gone (expired with its
    /// invocation's keys, or never stored), 64 for a malformed URI.
    Get {
        /// `toolfleet-blob:<invocation id>/<blob id>`, as a tool returned it.
        uri: String,
        /// The tenant whose invocation made the blob: invocation ids are
        /// unique per tenant only, and the store keeps each tenant's apart.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Where to write the bytes (stdout when omitted).
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// The fleet's prefix (the store's keys start with it).
        #[arg(long = "subject-prefix", env = toolfleet_service::args::ENV_SUBJECT_PREFIX, default_value = toolfleet_protocol::DEFAULT_PREFIX)]
        prefix: String,
        #[command(flatten)]
        redis: toolfleet_store::RedisOptions,
    },
}

/// `toolfleet blob get`: exit 0 once written, 1 when the blob is gone,
/// 64 for a malformed URI, tenant or prefix, or binary bytes bound for a
/// terminal.
pub async fn run(command: BlobCommand) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    let BlobCommand::Get {
        uri,
        tenant,
        output,
        prefix,
        redis,
    } = command;
    let uri = match toolfleet_protocol::blob::BlobUri::parse(&uri) {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("toolfleet blob get: {e}");
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
    };
    if !toolfleet_protocol::valid_tenant(&tenant) {
        eprintln!("toolfleet blob get: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if let Err(e) = toolfleet_protocol::Subjects::new(&prefix) {
        eprintln!("toolfleet blob get: {e}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let store = toolfleet_store::CitationStore::connect_with(&redis, &prefix, redis.ttl)
        .await
        .with_context(|| format!("cannot connect to Redis at {}", redis.redacted_url()))?;
    let inv = toolfleet_store::InvocationKey::new(&tenant, uri.invocation_id());
    let Some(blob) = store.get_blob(inv, uri.blob_id()).await? else {
        eprintln!(
            "toolfleet blob get: no blob at {uri} of tenant {tenant}: it expired with its \
             invocation's keys, was never stored, or is another tenant's (--tenant)"
        );
        return Ok(1);
    };
    match output {
        Some(path) => {
            std::fs::write(&path, &blob.bytes)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "wrote {} bytes of {} to {}",
                blob.bytes.len(),
                blob.content_type,
                path.display()
            );
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            let text = is_text(&blob.content_type) && std::str::from_utf8(&blob.bytes).is_ok();
            if stdout.is_terminal() && !text {
                eprintln!(
                    "toolfleet blob get: not writing {} bytes of {} to a terminal; \
                     use -o FILE or redirect stdout",
                    blob.bytes.len(),
                    blob.content_type
                );
                return Ok(toolfleet_service::args::EXIT_CONFIG);
            }
            stdout.write_all(&blob.bytes)?;
            stdout.flush()?;
        }
    }
    Ok(0)
}

/// Is a blob of this content type text a terminal can show?
fn is_text(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    essence.starts_with("text/")
        || essence == "application/json"
        || essence.ends_with("+json")
        || essence.ends_with("+xml")
}
