//! The fleet's tool catalog, as the workers advertise it.
//!
//! A worker advertises every tool it serves in two places:
//!
//! - the **definition** goes into the fleet's JetStream key-value bucket
//!   ([`Subjects::catalog_bucket`], `<P>_CATALOG`), keyed by the tool's
//!   subject token and the definition's [`digest`]
//!   (`ns.name.x_y_z.<digest>`, see [`key`]), before the worker takes any
//!   job. One key per definition, not per tool id: two workers of one id
//!   that serve different definitions (a rolling upgrade, a rollback) each
//!   keep theirs, and no later write can replace what a live worker serves;
//! - its **liveness** is its NATS services-API endpoint for the tool, whose
//!   metadata carries the tool id, the [`digest`] of the definition it
//!   serves and the fleet's prefix ([`META_TOOL_ID`], [`META_DIGEST`],
//!   [`META_FLEET`]), under the fleet's own service name
//!   ([`Subjects::worker_service`]).
//!
//! [`discover`] puts the two together into one [`Catalog`] value: the tools
//! some live worker of *this* fleet serves, each with the definition of the
//! digest its live workers advertise (fetched by that digest and checked
//! against it) and the number of live copies. A reader holds one value and
//! swaps it whole; definitions are fetched only when a digest changes, and
//! then concurrently.
//!
//! A model must never be offered one function name twice, so the catalog
//! offers at most one tool per function name ([`Catalog::iter`],
//! [`Catalog::by_function_name`]): the newest version of a tool (a rolling
//! upgrade), and between different tools the smallest id (a clash, logged
//! as an error). The others stay live ([`Catalog::is_live`]), so calls
//! already made to them are still answered.
//!
//! Nothing here reads a definition file: a tool from any host enters the
//! catalog through its worker.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;

use crate::Subjects;
use crate::tools::{CompiledTool, Origin, ToolDefinition, ToolId};

/// How long a definition stays in the bucket without being written again.
pub const CATALOG_MAX_AGE: Duration = Duration::from_secs(3600);

/// Endpoint metadata: the id of the tool the endpoint serves.
pub const META_TOOL_ID: &str = "toolId";
/// Endpoint metadata: the [`digest`] of the definition served.
pub const META_DIGEST: &str = "digest";
/// Endpoint metadata: the delivery mode (`jetstream` | `direct`).
pub const META_DELIVERY: &str = "delivery";
/// Service metadata: the fleet's subject prefix.
pub const META_FLEET: &str = "fleet";
/// Service metadata: the worker's family name.
pub const META_WORKER: &str = "worker";

/// How many definitions one reading fetches at a time.
const FETCH_CONCURRENCY: usize = 16;

/// The catalog could not be read or written.
#[derive(Debug, Clone, thiserror::Error)]
#[error("catalog: {0}")]
pub struct CatalogError(String);

impl CatalogError {
    fn new(context: &str, e: impl std::fmt::Display) -> Self {
        Self(format!("{context}: {e}"))
    }
}

/// A stable fingerprint of a definition (FNV-1a over its JSON, the bytes
/// [`advertise`] stores), so a reader refetches a definition only when the
/// served one changed, and can check that what it fetched is what the
/// live workers serve.
pub fn digest(definition: &ToolDefinition) -> String {
    digest_of_bytes(&serde_json::to_vec(definition).unwrap_or_default())
}

fn digest_of_bytes(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// The bucket key of one definition of `id`: `ns.name.x_y_z.<digest>`.
pub fn key(id: &ToolId, digest: &str) -> String {
    format!("{}.{digest}", id.subject_token())
}

/// The fleet's catalog bucket, created on first use
/// ([`crate::streams::key_value`]). Live workers write their definitions
/// again every minute; one no worker has written for [`CATALOG_MAX_AGE`]
/// (an old digest) leaves the bucket.
pub async fn bucket(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<kv::Store, CatalogError> {
    let name = subjects.catalog_bucket();
    crate::streams::key_value(
        js,
        &name,
        "toolfleet: tool definitions advertised by workers",
        CATALOG_MAX_AGE,
        true,
    )
    .await
    .map_err(|e| CatalogError(e.to_string()))
}

/// Writes `definition` into the catalog bucket under its [`key`] (a worker
/// does this for each tool before serving it). Returns its [`digest`].
pub async fn advertise(
    store: &kv::Store,
    definition: &ToolDefinition,
) -> Result<String, CatalogError> {
    let value = serde_json::to_vec(definition)
        .map_err(|e| CatalogError::new(&format!("{}", definition.id), e))?;
    let digest = digest_of_bytes(&value);
    store
        .put(key(&definition.id, &digest), value.into())
        .await
        .map_err(|e| CatalogError::new(&format!("advertising {}", definition.id), e))?;
    Ok(digest)
}

/// One tool some live worker of the fleet serves.
#[derive(Debug, Clone)]
pub struct CatalogEntry {
    /// The definition, checked and compiled once.
    pub tool: Arc<CompiledTool>,
    /// The [`digest`] of that definition: the one most live workers of
    /// the tool advertise, checked against the fetched bytes.
    pub digest: String,
    /// Live worker processes serving the tool id (whatever the digest).
    pub workers: usize,
    /// The family names of those workers, sorted, without repeats.
    pub families: Vec<String>,
}

impl CatalogEntry {
    /// The tool's definition, as the workers advertise it.
    pub fn definition(&self) -> &ToolDefinition {
        &self.tool.definition
    }
}

/// The catalog at one moment. Immutable: a newer reading is a new value.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Bumped whenever the set of tools or a definition changes.
    pub generation: u64,
    /// Bumped on every successful reading, changed or not.
    pub readings: u64,
    /// Every live tool, by id.
    entries: BTreeMap<String, CatalogEntry>,
    /// The one tool offered per function name: function name → tool id.
    offered: BTreeMap<String, String>,
    /// The live tools not offered, and why.
    shadowed: Vec<Shadowed>,
}

impl Catalog {
    /// A catalog of every live tool in `entries`, offering one per
    /// function name ([`one_per_function_name`]).
    fn new(entries: BTreeMap<String, CatalogEntry>, generation: u64, readings: u64) -> Self {
        let (offered, shadowed) = one_per_function_name(
            entries
                .values()
                .map(|e| (&e.definition().id, e.definition().function.name.as_str())),
        );
        Self {
            generation,
            readings,
            entries,
            offered,
            shadowed,
        }
    }

    /// The entry of a live tool id (`ns:name@x.y.z`), offered or not.
    pub fn get(&self, id: &str) -> Option<&CatalogEntry> {
        self.entries.get(id)
    }

    /// The offered entry whose function name is `name` (what a model
    /// calls): at most one tool has it.
    pub fn by_function_name(&self, name: &str) -> Option<&CatalogEntry> {
        self.offered.get(name).and_then(|id| self.entries.get(id))
    }

    /// Does a live worker serve `id`? True for a tool that is not offered
    /// because another one has its function name (an older version during
    /// a rolling upgrade): calls already made to it are still answered.
    pub fn is_live(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// The offered entries, sorted by tool id: at most one per function
    /// name.
    pub fn iter(&self) -> impl Iterator<Item = &CatalogEntry> {
        self.entries.iter().filter_map(|(id, e)| {
            (self.offered.get(&e.definition().function.name) == Some(id)).then_some(e)
        })
    }

    /// Every live entry, offered or not, sorted by tool id.
    pub fn all(&self) -> impl Iterator<Item = &CatalogEntry> {
        self.entries.values()
    }

    /// How many entries are offered.
    pub fn len(&self) -> usize {
        self.offered.len()
    }

    /// Whether no entry is offered.
    pub fn is_empty(&self) -> bool {
        self.offered.is_empty()
    }

    /// A catalog of the given tools, each served by one worker (tests and
    /// readers that build a catalog without NATS). Offers one per function
    /// name, like [`discover`].
    pub fn from_tools(tools: impl IntoIterator<Item = Arc<CompiledTool>>) -> Self {
        let entries = tools
            .into_iter()
            .map(|tool| {
                (
                    tool.definition.id.to_string(),
                    CatalogEntry {
                        digest: digest(&tool.definition),
                        tool,
                        workers: 1,
                        families: Vec::new(),
                    },
                )
            })
            .collect();
        let catalog = Self::new(entries, 1, 1);
        log_shadowed(&catalog.shadowed, &[]);
        catalog
    }
}

/// Why a live tool is not offered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shadowed {
    /// A newer version of the same `namespace:name` is live (a rolling
    /// upgrade, or its leftovers).
    Older { tool: ToolId, newer: ToolId },
    /// A different tool with the same function name is offered.
    Clash {
        function: String,
        tool: ToolId,
        offered: ToolId,
    },
}

/// The rule that keeps a function name unique among the offered tools,
/// over `(tool id, function name)` pairs: among the tools of one function
/// name, each `namespace:name` is represented by its highest version
/// (compared as numbers: 1.10.0 is newer than 1.9.0), and of those the
/// smallest id is offered. Returns function name → offered id, and what
/// was left out.
fn one_per_function_name<'a>(
    tools: impl IntoIterator<Item = (&'a ToolId, &'a str)>,
) -> (BTreeMap<String, String>, Vec<Shadowed>) {
    let mut by_function: BTreeMap<&str, Vec<&ToolId>> = BTreeMap::new();
    for (id, function) in tools {
        by_function.entry(function).or_default().push(id);
    }
    let mut offered = BTreeMap::new();
    let mut shadowed = Vec::new();
    for (function, mut ids) in by_function {
        // By namespace and name, then newest first: the first id is the
        // one offered, the first of each later `namespace:name` a clash.
        ids.sort_by(|a, b| {
            (&a.namespace, &a.name, std::cmp::Reverse(a.version)).cmp(&(
                &b.namespace,
                &b.name,
                std::cmp::Reverse(b.version),
            ))
        });
        let mut ids = ids.into_iter();
        let Some(first) = ids.next() else {
            continue;
        };
        let mut newest = first;
        for id in ids {
            if (&id.namespace, &id.name) == (&newest.namespace, &newest.name) {
                shadowed.push(Shadowed::Older {
                    tool: id.clone(),
                    newer: newest.clone(),
                });
            } else {
                shadowed.push(Shadowed::Clash {
                    function: function.to_string(),
                    tool: id.clone(),
                    offered: first.clone(),
                });
                newest = id;
            }
        }
        offered.insert(function.to_string(), first.to_string());
    }
    (offered, shadowed)
}

/// Logs what is `shadowed` now and was not in `before` (once, not on
/// every reading).
fn log_shadowed(shadowed: &[Shadowed], before: &[Shadowed]) {
    for s in shadowed.iter().filter(|s| !before.contains(s)) {
        match s {
            Shadowed::Older { tool, newer } => tracing::info!(
                %tool, %newer,
                "an older version of a tool is still live: offering only the newer one"
            ),
            Shadowed::Clash {
                function,
                tool,
                offered,
            } => tracing::error!(
                function = %function, %offered, left_out = %tool,
                "two live tools share the function name {function:?}: offering {offered}, \
                 not {tool}; give one of them another function name"
            ),
        }
    }
}

/// What the services API says of one tool id: its live copies, by the
/// digest each advertises.
#[derive(Debug, Default)]
struct Liveness {
    /// Digest → live workers advertising it.
    digests: BTreeMap<String, usize>,
    families: Vec<String>,
}

impl Liveness {
    fn workers(&self) -> usize {
        self.digests.values().sum()
    }

    /// The definition to offer when live workers disagree (a rolling
    /// upgrade): the digest most of them serve, ties broken by the greater
    /// digest, so every reader picks the same one.
    fn digest(&self) -> Option<&str> {
        self.digests
            .iter()
            .max_by(|(a, na), (b, nb)| na.cmp(nb).then_with(|| a.cmp(b)))
            .map(|(d, _)| d.as_str())
    }
}

/// A definition one reading has to fetch: the tool, the digest its live
/// workers advertise, and what the entry will say of them.
#[derive(Debug)]
struct Wanted {
    id: ToolId,
    digest: String,
    live: Liveness,
}

/// Reads the catalog: which tools live workers of this fleet serve (their
/// services-API `INFO` answers, collected for `wait`), with definitions
/// from the catalog bucket — reused from `previous` when the digest did not
/// change, otherwise fetched by digest, concurrently. A definition that
/// cannot be fetched, is not the advertised one, or does not pass the
/// definition checks is left out and logged; it never fails the reading.
pub async fn discover(
    client: &async_nats::Client,
    subjects: &Subjects,
    wait: Duration,
    previous: &Catalog,
) -> Result<Catalog, CatalogError> {
    let live = liveness(client, subjects, wait).await?;
    let mut entries = BTreeMap::new();
    let mut wanted = Vec::new();
    for (id, seen) in live {
        let Some(digest) = seen.digest().map(str::to_string) else {
            continue;
        };
        if seen.digests.len() > 1 {
            tracing::warn!(tool = %id, offered = %digest, digests = ?seen.digests,
                "live workers of one tool serve different definitions (a rolling upgrade?); \
                 offering the one most of them serve");
        }
        if let Some(prev) = previous.entries.get(&id)
            && prev.digest == digest
        {
            entries.insert(
                id,
                CatalogEntry {
                    workers: seen.workers(),
                    families: seen.families,
                    ..prev.clone()
                },
            );
            continue;
        }
        match id.parse::<ToolId>() {
            Ok(id) => wanted.push(Wanted {
                id,
                digest,
                live: seen,
            }),
            Err(e) => tracing::warn!(tool = %id, error = %e, "advertised tool id; left out"),
        }
    }
    if !wanted.is_empty() {
        let store = bucket(&jetstream::new(client.clone()), subjects).await?;
        for (want, fetched) in fetch_all(&store, wanted).await {
            match fetched {
                Ok(tool) => {
                    entries.insert(
                        want.id.to_string(),
                        CatalogEntry {
                            tool: Arc::new(tool),
                            workers: want.live.workers(),
                            digest: want.digest,
                            families: want.live.families,
                        },
                    );
                }
                Err(e) => {
                    // Still live: keep serving the definition we had (a
                    // digest not written yet, a read that failed) rather
                    // than dropping a tool its workers serve.
                    let id = want.id.to_string();
                    match previous.entries.get(&id) {
                        Some(prev) => {
                            tracing::warn!(tool = %id, digest = %want.digest, error = %e,
                                "definition not fetched; keeping the previous one");
                            entries.insert(
                                id,
                                CatalogEntry {
                                    workers: want.live.workers(),
                                    families: want.live.families,
                                    ..prev.clone()
                                },
                            );
                        }
                        None => tracing::warn!(tool = %id, digest = %want.digest, error = %e,
                            "tool left out of the catalog"),
                    }
                }
            }
        }
    }
    let changed = entries.len() != previous.entries.len()
        || entries
            .iter()
            .zip(previous.entries.iter())
            .any(|((a, ea), (b, eb))| a != b || ea.digest != eb.digest);
    let catalog = Catalog::new(
        entries,
        previous.generation + u64::from(changed),
        previous.readings + 1,
    );
    log_shadowed(&catalog.shadowed, &previous.shadowed);
    Ok(catalog)
}

/// Where definitions are read from: the catalog bucket, or a stand-in in
/// tests.
trait Definitions: Sync {
    /// The value under `key`, if any.
    fn value(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<bytes::Bytes>, CatalogError>> + Send;
}

impl Definitions for kv::Store {
    async fn value(&self, key: &str) -> Result<Option<bytes::Bytes>, CatalogError> {
        self.get(key)
            .await
            .map_err(|e| CatalogError::new("reading the definition", e))
    }
}

/// Every `wanted` definition, [`FETCH_CONCURRENCY`] at a time (a first
/// reading of hundreds of tools is not hundreds of round trips in a row),
/// in no particular order.
async fn fetch_all(
    source: &impl Definitions,
    wanted: Vec<Wanted>,
) -> Vec<(Wanted, Result<CompiledTool, CatalogError>)> {
    futures::stream::iter(wanted)
        .map(|want| async move {
            let fetched = fetch(source, &want.id, &want.digest).await;
            (want, fetched)
        })
        .buffer_unordered(FETCH_CONCURRENCY)
        .collect()
        .await
}

/// The definition of `id` whose digest is `digest`, checked and compiled.
async fn fetch(
    source: &impl Definitions,
    id: &ToolId,
    digest: &str,
) -> Result<CompiledTool, CatalogError> {
    let key = key(id, digest);
    let bytes = match source.value(&key).await? {
        Some(bytes) => bytes,
        // Workers of earlier releases wrote one value per tool id, under
        // the subject token alone: still good if it is the advertised one,
        // which the digest check below makes sure of.
        None => source
            .value(&id.subject_token())
            .await?
            .ok_or_else(|| CatalogError(format!("no definition {key} in the catalog bucket")))?,
    };
    let found = digest_of_bytes(&bytes);
    if found != digest {
        return Err(CatalogError(format!(
            "the catalog bucket holds a definition of digest {found} for {key}, not the advertised {digest}"
        )));
    }
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| CatalogError::new("definition JSON", e))?;
    let definition =
        ToolDefinition::from_value(value, Origin::Named(format!("catalog entry {key}")))
            .map_err(|e| CatalogError::new("definition", e))?;
    if definition.id != *id {
        return Err(CatalogError(format!(
            "the catalog entry {key} holds {}, not {id}",
            definition.id
        )));
    }
    CompiledTool::new(definition).map_err(|e| CatalogError::new("definition", e))
}

/// Tool id → liveness, from the `INFO` answers of this fleet's workers.
/// Every answer to one request on `subject` within `wait` (a services API
/// verb such as `$SRV.INFO.<service>`, which every instance answers).
///
/// # Errors
///
/// [`CatalogError`] when the request cannot be sent.
pub async fn ask_all(
    client: &async_nats::Client,
    subject: &str,
    wait: Duration,
) -> Result<Vec<bytes::Bytes>, CatalogError> {
    let inbox = client.new_inbox();
    let mut sub = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| CatalogError::new("subscribe", e))?;
    client
        .publish_with_reply(subject.to_string(), inbox, bytes::Bytes::new())
        .await
        .map_err(|e| CatalogError::new("publish", e))?;
    client
        .flush()
        .await
        .map_err(|e| CatalogError::new("flush", e))?;
    let mut answers = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, sub.next()).await {
        answers.push(msg.payload);
    }
    Ok(answers)
}

async fn liveness(
    client: &async_nats::Client,
    subjects: &Subjects,
    wait: Duration,
) -> Result<HashMap<String, Liveness>, CatalogError> {
    let answers = ask_all(
        client,
        &format!("$SRV.INFO.{}", subjects.worker_service()),
        wait,
    )
    .await?;
    let mut live: HashMap<String, Liveness> = HashMap::new();
    for payload in answers {
        let Ok(info) = serde_json::from_slice::<async_nats::service::Info>(&payload) else {
            continue;
        };
        // Service names are one-to-one with prefixes; this is a second
        // guard, should a worker of another fleet register under ours.
        if info.metadata.get(META_FLEET).map(String::as_str) != Some(subjects.prefix()) {
            continue;
        }
        let family = info.metadata.get(META_WORKER).cloned().unwrap_or_default();
        for e in info.endpoints {
            let (Some(id), Some(digest)) =
                (e.metadata.get(META_TOOL_ID), e.metadata.get(META_DIGEST))
            else {
                continue;
            };
            let entry = live.entry(id.clone()).or_default();
            *entry.digests.entry(digest.clone()).or_default() += 1;
            if !family.is_empty() && !entry.families.contains(&family) {
                entry.families.push(family.clone());
                entry.families.sort();
            }
        }
    }
    Ok(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn definition() -> ToolDefinition {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tool_definitions/system.current_datetime.json"
        );
        crate::tools::load_file(path).expect("shipped definition")
    }

    /// The shipped `current_datetime` definition under another id (same
    /// function name).
    fn definition_as(id: &str) -> ToolDefinition {
        let mut d = definition();
        d.id = id.parse().expect("tool id");
        d
    }

    fn tool(id: &str) -> Arc<CompiledTool> {
        Arc::new(CompiledTool::new(definition_as(id)).expect("compiles"))
    }

    fn offered_ids(catalog: &Catalog) -> Vec<String> {
        catalog
            .iter()
            .map(|e| e.definition().id.to_string())
            .collect()
    }

    #[test]
    fn digest_is_stable_and_changes_with_the_definition() {
        let a = definition();
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_eq!(digest(&a).len(), 16);
        let mut b = a.clone();
        b.description.push_str(" (changed)");
        assert_ne!(digest(&a), digest(&b));
        // The digest is over the bytes the bucket holds.
        let stored = serde_json::to_vec(&a).expect("JSON");
        assert_eq!(digest_of_bytes(&stored), digest(&a));
        assert_eq!(
            key(&a.id, &digest(&a)),
            format!("system.current_datetime.1_0_0.{}", digest(&a))
        );
    }

    #[test]
    fn a_catalog_built_from_tools_finds_them_by_id_and_function_name() {
        let tool = Arc::new(CompiledTool::new(definition()).expect("compiles"));
        let catalog = Catalog::from_tools([tool.clone()]);
        let id = tool.definition.id.to_string();
        assert!(catalog.is_live(&id));
        assert_eq!(catalog.len(), 1);
        assert_eq!(
            catalog
                .by_function_name(&tool.definition.function.name)
                .map(|e| e.definition().id.to_string()),
            Some(id)
        );
        assert!(catalog.get("system:nope@1.0.0").is_none());
    }

    /// A rolling upgrade: several versions of one tool are live. The model
    /// is offered the function name once, for the newest version by
    /// number (1.10.0 sorts before 1.9.0 as a string); the older ones stay
    /// live for calls already made to them.
    #[test]
    fn of_several_live_versions_only_the_newest_is_offered() {
        let catalog = Catalog::from_tools([
            tool("system:current_datetime@1.0.0"),
            tool("system:current_datetime@1.9.0"),
            tool("system:current_datetime@1.10.0"),
            tool("system:current_datetime@0.12.0"),
        ]);
        assert_eq!(offered_ids(&catalog), ["system:current_datetime@1.10.0"]);
        assert_eq!(catalog.len(), 1);
        assert_eq!(
            catalog
                .by_function_name("current_datetime")
                .map(|e| e.definition().id.to_string())
                .as_deref(),
            Some("system:current_datetime@1.10.0")
        );
        for older in ["1.0.0", "1.9.0", "0.12.0"] {
            assert!(catalog.is_live(&format!("system:current_datetime@{older}")));
        }
    }

    /// Two different tools (here two namespaces) reuse a function name:
    /// one is offered, always the same one (the smallest id), whatever the
    /// order the tools come in; tools with other names are unaffected.
    #[test]
    fn a_function_name_clash_between_tools_offers_the_smallest_id() {
        let search = {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../tool_definitions/retrieval.search_documents.json"
            );
            let d = crate::tools::load_file(path).expect("shipped definition");
            Arc::new(CompiledTool::new(d).expect("compiles"))
        };
        let tools = [
            tool("system:current_datetime@1.0.0"),
            tool("system:current_datetime@1.1.0"),
            tool("clock:current_datetime@2.0.0"),
            tool("clock:now@0.1.0"),
            search,
        ];
        let catalog = Catalog::from_tools(tools.clone());
        assert_eq!(
            offered_ids(&catalog),
            [
                "clock:current_datetime@2.0.0",
                "retrieval:search_documents@1.0.0"
            ]
        );
        assert_eq!(
            catalog
                .by_function_name("current_datetime")
                .map(|e| e.definition().id.to_string())
                .as_deref(),
            Some("clock:current_datetime@2.0.0")
        );
        assert!(catalog.is_live("system:current_datetime@1.1.0"));
        let id = |s: &str| s.parse::<ToolId>().expect("tool id");
        assert_eq!(
            catalog.shadowed,
            [
                Shadowed::Clash {
                    function: "current_datetime".into(),
                    tool: id("clock:now@0.1.0"),
                    offered: id("clock:current_datetime@2.0.0"),
                },
                Shadowed::Clash {
                    function: "current_datetime".into(),
                    tool: id("system:current_datetime@1.1.0"),
                    offered: id("clock:current_datetime@2.0.0"),
                },
                Shadowed::Older {
                    tool: id("system:current_datetime@1.0.0"),
                    newer: id("system:current_datetime@1.1.0"),
                },
            ]
        );
        // The same answer in any order.
        let reversed = Catalog::from_tools(tools.into_iter().rev());
        assert_eq!(offered_ids(&reversed), offered_ids(&catalog));
        assert_eq!(reversed.shadowed, catalog.shadowed);
    }

    /// Live workers of one tool disagree on the definition: the digest
    /// most of them serve, ties to the greater digest, never the order
    /// the answers came in.
    #[test]
    fn the_digest_most_live_workers_serve_is_chosen() {
        let live = |pairs: &[(&str, usize)]| Liveness {
            digests: pairs.iter().map(|(d, n)| (d.to_string(), *n)).collect(),
            families: Vec::new(),
        };
        assert_eq!(live(&[("aa", 2), ("bb", 1)]).digest(), Some("aa"));
        assert_eq!(live(&[("bb", 1), ("aa", 2)]).digest(), Some("aa"));
        assert_eq!(
            live(&[("aa", 2), ("bb", 2), ("01", 1)]).digest(),
            Some("bb")
        );
        assert_eq!(live(&[("aa", 2), ("bb", 2), ("01", 1)]).workers(), 5);
        assert_eq!(live(&[]).digest(), None);
    }

    /// A stand-in bucket: fixed values, and every read waits at `gate`
    /// until as many reads as it counts are in flight together.
    struct Stand {
        values: HashMap<String, bytes::Bytes>,
        gate: tokio::sync::Barrier,
    }

    impl Stand {
        fn new(definitions: &[&ToolDefinition], together: usize) -> Self {
            let values = definitions
                .iter()
                .map(|d| {
                    let bytes = serde_json::to_vec(d).expect("JSON");
                    (key(&d.id, &digest(d)), bytes.into())
                })
                .collect();
            Self {
                values,
                gate: tokio::sync::Barrier::new(together),
            }
        }
    }

    impl Definitions for Stand {
        async fn value(&self, key: &str) -> Result<Option<bytes::Bytes>, CatalogError> {
            self.gate.wait().await;
            Ok(self.values.get(key).cloned())
        }
    }

    /// Every await in these tests is bounded.
    async fn within<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("in time")
    }

    fn wanted(d: &ToolDefinition) -> Wanted {
        Wanted {
            id: d.id.clone(),
            digest: digest(d),
            live: Liveness::default(),
        }
    }

    /// The definitions of one reading are fetched together: the stand-in
    /// answers none until four reads are in flight at once, so fetching
    /// one after another would never finish.
    #[tokio::test]
    async fn definitions_are_fetched_concurrently() {
        let defs: Vec<ToolDefinition> = (0..4)
            .map(|i| definition_as(&format!("system:current_datetime@1.{i}.0")))
            .collect();
        let stand = Stand::new(&defs.iter().collect::<Vec<_>>(), defs.len());
        let fetched = tokio::time::timeout(
            Duration::from_secs(10),
            fetch_all(&stand, defs.iter().map(wanted).collect()),
        )
        .await
        .expect("four reads in flight at once");
        let mut ids: Vec<String> = fetched
            .into_iter()
            .map(|(want, tool)| {
                let tool = tool.expect("fetched");
                assert_eq!(tool.definition.id, want.id);
                want.id.to_string()
            })
            .collect();
        ids.sort();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids[0], "system:current_datetime@1.0.0");
    }

    /// What is fetched is the advertised digest, checked: another
    /// definition of the same tool in the bucket is not taken for it, and
    /// bytes that are not the advertised definition are refused.
    #[tokio::test]
    async fn the_fetched_definition_is_the_advertised_one() {
        let old = definition();
        let mut new = definition();
        new.description.push_str(" (new)");
        let stand = Stand::new(&[&old, &new], 1);
        for d in [&old, &new] {
            let tool = within(fetch(&stand, &d.id, &digest(d)))
                .await
                .expect("fetched");
            assert_eq!(digest(&tool.definition), digest(d));
        }
        // A value under the key that is not the definition of that digest.
        let mut forged = Stand::new(&[], 1);
        forged.values.insert(
            key(&old.id, &digest(&old)),
            serde_json::to_vec(&new).expect("JSON").into(),
        );
        let error = within(fetch(&forged, &old.id, &digest(&old)))
            .await
            .expect_err("not the advertised definition");
        assert!(error.to_string().contains("not the advertised"), "{error}");
        // Nothing under the key.
        let error = within(fetch(&Stand::new(&[], 1), &old.id, &digest(&old)))
            .await
            .expect_err("absent");
        assert!(error.to_string().contains("no definition"), "{error}");
    }

    /// A worker of an earlier release wrote its definition under the
    /// subject token alone: taken if it is the advertised digest, refused
    /// if it is another one.
    #[tokio::test]
    async fn a_definition_under_the_earlier_key_is_taken_only_with_its_digest() {
        let d = definition();
        let mut stand = Stand::new(&[], 1);
        stand.values.insert(
            d.id.subject_token(),
            serde_json::to_vec(&d).expect("JSON").into(),
        );
        let tool = within(fetch(&stand, &d.id, &digest(&d)))
            .await
            .expect("fetched");
        assert_eq!(tool.definition.id, d.id);
        let error = within(fetch(&stand, &d.id, "0123456789abcdef"))
            .await
            .expect_err("another digest");
        assert!(error.to_string().contains("not the advertised"), "{error}");
    }
}
