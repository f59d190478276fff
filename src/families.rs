//! The tool families `toolfleet up`, the demo and the bench start in one
//! process. Adding a family to those commands is one entry here; nothing
//! else in the workspace's generic assembly names a family.

use std::path::Path;

use anyhow::Context;
use toolfleet_worker::Worker;

pub use toolfleet_worker_retrieval::IndexArgs;

/// The families this command ships, by name.
pub const NAMES: &[&str] = &[
    toolfleet_worker_system::FAMILY,
    toolfleet_worker_retrieval::FAMILY,
];

/// Every family this command ships, with the definitions in `definitions`.
pub fn all(definitions: &Path, index: &IndexArgs) -> anyhow::Result<Vec<Worker>> {
    some(NAMES, definitions, index)
}

/// The named families; the index is opened (or built) only when the
/// retrieval family is among them.
pub fn some(names: &[&str], definitions: &Path, index: &IndexArgs) -> anyhow::Result<Vec<Worker>> {
    names
        .iter()
        .map(|name| match *name {
            toolfleet_worker_system::FAMILY => Ok(toolfleet_worker_system::worker(definitions)?),
            toolfleet_worker_retrieval::FAMILY => {
                let docs = toolfleet_worker_retrieval::open_or_build_index(
                    &index.index_dir,
                    &index.corpus_dir,
                )
                .with_context(|| {
                    format!(
                        "opening or building the index at {} from {}",
                        index.index_dir.display(),
                        index.corpus_dir.display()
                    )
                })?;
                Ok(toolfleet_worker_retrieval::worker(definitions, &docs)?)
            }
            other => anyhow::bail!("no tool family named {other:?} (known: {NAMES:?})"),
        })
        .collect()
}
