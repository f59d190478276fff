//! [`DeclaredPools`]: the tools of the worker pools the profiles file
//! declares (`[pools.<name>] declared = true`), offered while none of
//! their workers is live, so a pool that scales from zero gets the jobs
//! that start it.
//!
//! Their definitions come from the orchestrator's definitions directory
//! (`--tool-definitions`, the same files the pool's workers serve), not
//! from the catalog bucket: the bucket keeps a definition only for an hour
//! after its last live worker wrote it (a pool idle overnight would lose
//! its tools), holds nothing at all before the pool's first start, and
//! does not say which pool serves a tool. Files are there from the first
//! start, reviewed with the deployment, and checked before any work.
//!
//! Resolved once at start ([`DeclaredPools::load`], exit 64 on a problem):
//! each declared pool's refs must match definitions (a name that matches
//! none is an unknown pool), a tool belongs to one pool, and only tools
//! with JetStream delivery can wait for a worker (a direct call with no
//! worker has nobody to wait on). Once a worker serves a tool, the live
//! catalog's definition is the one offered; the declared one stands in
//! only while none is live.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use toolfleet_config::FleetConfig;
use toolfleet_protocol::tools::{CompiledTool, Delivery, ToolDefinition, load_dir};

/// The registry backend name of the declared tools not served by a live
/// worker.
pub const DECLARED_SOURCE: &str = "declared";

/// The declared pools' tools, by tool id. Immutable once resolved.
#[derive(Clone, Debug, Default)]
pub struct DeclaredPools {
    /// Tool id → its pool and compiled definition.
    tools: BTreeMap<String, (String, Arc<CompiledTool>)>,
}

impl DeclaredPools {
    /// No pool declared.
    pub fn none() -> Self {
        Self::default()
    }

    /// The declared pools of `profiles`, their tools from the definition
    /// files in `definitions` (read only when a pool is declared).
    ///
    /// # Errors
    ///
    /// A message naming the pool's key: the directory cannot be read, a
    /// ref matches no definition (an unknown pool, or a misspelt tool), a
    /// tool is in two pools, or a tool has direct delivery.
    pub fn load(profiles: &FleetConfig, definitions: &Path) -> Result<Self, String> {
        if profiles.declared_pools().next().is_none() {
            return Ok(Self::none());
        }
        let found = load_dir(definitions).map_err(|e| {
            format!(
                "the tools of the declared pools are read from {}: {e}",
                definitions.display()
            )
        })?;
        Self::resolve(profiles, found, &definitions.display().to_string())
    }

    /// [`load`](Self::load) over definitions already read; `dir` names
    /// where they came from in messages.
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load).
    pub fn resolve(
        profiles: &FleetConfig,
        definitions: Vec<ToolDefinition>,
        dir: &str,
    ) -> Result<Self, String> {
        let mut tools = BTreeMap::new();
        for (pool, config) in profiles.declared_pools() {
            // Checked at load: a pool without `tools` is named like a
            // namespace.
            let refs = config.tool_refs(pool).unwrap_or_default();
            for r in &refs {
                let matched: Vec<&ToolDefinition> =
                    definitions.iter().filter(|d| r.matches(&d.id)).collect();
                if matched.is_empty() {
                    return Err(unmatched(
                        pool,
                        config.tools.is_none(),
                        r,
                        &definitions,
                        dir,
                    ));
                }
                for def in matched {
                    let id = def.id.to_string();
                    if def.delivery != Delivery::Jetstream {
                        return Err(format!(
                            "pools.{pool}: {id} has direct delivery: a call with no live worker \
                             has no queue to wait in, so it cannot be declared (name the pool's \
                             JetStream tools in pools.{pool}.tools)"
                        ));
                    }
                    if let Some((other, _)) = tools.get(&id)
                        && other != pool
                    {
                        return Err(format!(
                            "pools.{pool}: {id} is declared in pools.{other} too: a tool is \
                             served by one pool"
                        ));
                    }
                    let compiled = CompiledTool::new(def.clone())
                        .map_err(|e| format!("pools.{pool}: {id}: {e}"))?;
                    tools.insert(id, (pool.clone(), Arc::new(compiled)));
                }
            }
        }
        Ok(Self { tools })
    }

    /// The declared pool serving `tool_id`, if any.
    pub fn pool_of(&self, tool_id: &str) -> Option<&str> {
        self.tools.get(tool_id).map(|(pool, _)| pool.as_str())
    }

    /// Every declared tool, in id order.
    pub fn tools(&self) -> impl Iterator<Item = &Arc<CompiledTool>> {
        self.tools.values().map(|(_, tool)| tool)
    }

    /// Each declared pool and its tools' ids, by pool (for the start-up
    /// log).
    pub fn by_pool(&self) -> BTreeMap<&str, Vec<&str>> {
        let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (id, (pool, _)) in &self.tools {
            out.entry(pool).or_default().push(id);
        }
        out
    }

    /// Whether no tool is declared.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

/// The message for a declared pool's ref `r` that matches no definition:
/// for a pool's default ref, an unknown pool.
fn unmatched(
    pool: &str,
    by_default: bool,
    r: &toolfleet_protocol::tools::ToolRef,
    definitions: &[ToolDefinition],
    dir: &str,
) -> String {
    let namespaces: BTreeSet<&str> = definitions
        .iter()
        .map(|d| d.id.namespace.as_str())
        .collect();
    let namespaces = if namespaces.is_empty() {
        "none".to_owned()
    } else {
        namespaces.into_iter().collect::<Vec<_>>().join(", ")
    };
    if by_default {
        format!(
            "pools.{pool}: unknown pool: no tool definition in {dir} is in the namespace \
             {pool:?} (the namespaces there: {namespaces}); is the name misspelt? A pool whose \
             tools are in other namespaces lists them in pools.{pool}.tools"
        )
    } else {
        format!(
            "pools.{pool}.tools: {r} matches no tool definition in {dir} (the namespaces there: \
             {namespaces})"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn definitions() -> Vec<ToolDefinition> {
        load_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tool_definitions"
        ))
        .expect("the shipped definitions")
    }

    fn config(pools: &str) -> FleetConfig {
        FleetConfig::from_toml(
            &format!(
                "[deployments.d]\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\n\
                 [profiles.default]\ndeployment = \"d\"\n{pools}"
            ),
            "test.toml",
        )
        .expect("config")
    }

    fn resolve(pools: &str) -> Result<DeclaredPools, String> {
        DeclaredPools::resolve(&config(pools), definitions(), "tool_definitions")
    }

    #[test]
    fn a_declared_pool_has_its_namespaces_tools() {
        let declared = resolve("[pools.web]\ndeclared = true\n[pools.system]\n").unwrap();
        assert_eq!(
            declared
                .tools()
                .map(|t| t.definition.id.to_string())
                .collect::<Vec<_>>(),
            ["web:read_page@1.0.0", "web:search@1.0.0"]
        );
        assert_eq!(declared.pool_of("web:search@1.0.0"), Some("web"));
        assert_eq!(
            declared.pool_of("system:current_datetime@1.0.0"),
            None,
            "an undeclared pool's table declares nothing"
        );
        let llm = resolve(
            "[pools.llm]\ndeclared = true\ntools = [\"llm:*\", \"content:generate_chart\"]\n",
        )
        .unwrap();
        assert_eq!(llm.by_pool()["llm"].len(), 7);
        assert!(llm.pool_of("content:generate_chart@1.0.0").is_some());
        assert!(resolve("").unwrap().is_empty());
    }

    #[test]
    fn an_unknown_pool_or_tool_a_shared_tool_and_a_direct_tool_are_refused() {
        let e = resolve("[pools.wbe]\ndeclared = true\n").unwrap_err();
        assert!(e.starts_with("pools.wbe: unknown pool"), "{e}");
        assert!(e.contains("retrieval, system, web"), "{e}");
        let e = resolve("[pools.web]\ndeclared = true\ntools = [\"web:serch\"]\n").unwrap_err();
        assert!(
            e.starts_with("pools.web.tools: web:serch matches no tool definition"),
            "{e}"
        );
        let e = resolve(
            "[pools.web]\ndeclared = true\n[pools.other]\ndeclared = true\ntools = [\"web:search\"]\n",
        )
        .unwrap_err();
        assert!(e.contains("is declared in pools.other too"), "{e}");
        let mut direct = definitions();
        for d in &mut direct {
            d.delivery = Delivery::Direct;
        }
        let e = DeclaredPools::resolve(
            &config("[pools.web]\ndeclared = true\n"),
            direct,
            "tool_definitions",
        )
        .unwrap_err();
        assert!(e.contains("has direct delivery"), "{e}");
    }

    #[test]
    fn an_unreadable_directory_is_refused_only_when_a_pool_is_declared() {
        let missing = Path::new("/nonexistent/toolfleet/definitions");
        assert!(DeclaredPools::load(&config("[pools.web]\n"), missing).is_ok());
        let e =
            DeclaredPools::load(&config("[pools.web]\ndeclared = true\n"), missing).unwrap_err();
        assert!(e.contains("/nonexistent/toolfleet/definitions"), "{e}");
    }
}
