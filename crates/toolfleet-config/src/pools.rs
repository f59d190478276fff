//! Worker pools the orchestrator knows of before any of their workers is
//! live: `[pools.<name>]`, for a pool that scales from zero.
//!
//! A tool is offered to the model only while a live worker serves it, so
//! a pool at zero replicas would never see a job, and an autoscaler that
//! scales on the pool's backlog (KEDA) would never start it. A **declared**
//! pool's tools are offered while none of its workers is live: their
//! definitions come from the orchestrator's own definitions directory
//! (`--tool-definitions`), their jobs queue on the tools' durable consumers
//! (which the orchestrator makes, as a worker would), and a call waits for
//! the pool's first worker until its job's deadline instead of being
//! answered `no_worker`.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `pools.<name>.declared` | bool, `false` | offer the pool's tools while none of its workers is live |
//! | `pools.<name>.tools` | list of tool refs, `["<name>:*"]` | the pool's tools: `ns:*` (every definition of a namespace), `ns:name` or `ns:name@x.y.z`; `*` is refused (no pool serves every tool) |
//!
//! ```toml
//! [pools.web]
//! declared = true            # its tools: web:* (web:search, web:read_page)
//!
//! [pools.llm]
//! declared = true
//! tools = ["llm:*", "content:generate_chart"]
//! ```
//!
//! Checked here: the pool's name (letters, digits, `_`, `-`, `.`), and its
//! tools (a list that is not empty, without `*`; a pool whose name is no
//! tool namespace must list them). What a pool's refs match — a name that
//! matches no definition is an unknown pool — is checked by the
//! orchestrator at start, against its definitions directory.

use std::collections::BTreeMap;

use serde::Deserialize;
use toolfleet_llm::config_file::{check_name, key_segment};
use toolfleet_protocol::tools::ToolRef;

/// One `[pools.<name>]` table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Offer the pool's tools while none of its workers is live: their
    /// jobs queue for its first worker (scale from zero).
    #[serde(default)]
    pub declared: bool,
    /// The pool's tools; `None`: every definition of the namespace named
    /// like the pool (`<name>:*`).
    #[serde(default)]
    pub tools: Option<Vec<ToolRef>>,
}

impl PoolConfig {
    /// The refs naming the pool `name`'s tools: its `tools`, else
    /// `<name>:*`. `None` when it lists none and `name` is no namespace
    /// (refused at load).
    pub fn tool_refs(&self, name: &str) -> Option<Vec<ToolRef>> {
        match &self.tools {
            Some(tools) => Some(tools.clone()),
            None => format!("{name}:*").parse().ok().map(|r| vec![r]),
        }
    }
}

/// Each pool's name and tools (`FleetConfig`'s check of `[pools]`); the
/// error is `(key path, message)` of the first problem.
pub(crate) fn check(pools: &BTreeMap<String, PoolConfig>) -> Result<(), (String, String)> {
    for (name, pool) in pools {
        let at = format!("pools.{}", key_segment(name));
        check_name(name).map_err(|m| (at.clone(), m))?;
        match &pool.tools {
            Some(tools) if tools.is_empty() => {
                return Err((
                    format!("{at}.tools"),
                    "is empty: name the pool's tools, or leave the key out for every tool of the namespace named like the pool".to_owned(),
                ));
            }
            Some(tools) => {
                if let Some(i) = tools.iter().position(|r| *r == ToolRef::All) {
                    return Err((
                        format!("{at}.tools[{i}]"),
                        "`*` is every tool of the fleet, and no pool serves them all: name the pool's namespaces (`ns:*`) or tools".to_owned(),
                    ));
                }
            }
            None if pool.tool_refs(name).is_none() => {
                return Err((
                    at,
                    format!(
                        "{name:?} is no tool namespace, so the pool's tools cannot default to its namespace's: list them in `tools`"
                    ),
                ));
            }
            None => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::ConfigErrorKind;
    use crate::testing::{EXAMPLE, MINIMAL, parse, parse_err};
    use toolfleet_protocol::tools::ToolRef;

    #[test]
    fn a_declared_pool_defaults_to_its_namespace() {
        let config = parse(&format!(
            "{MINIMAL}\n[pools.web]\ndeclared = true\n[pools.system]\n"
        ))
        .unwrap();
        let declared: Vec<&str> = config.declared_pools().map(|(n, _)| n.as_str()).collect();
        assert_eq!(declared, ["web"], "an undeclared table is no declaration");
        assert_eq!(
            config.pools["web"].tool_refs("web"),
            Some(vec![ToolRef::Namespace("web".into())])
        );
        let listed = parse(&format!(
            "{MINIMAL}\n[pools.llm]\ndeclared = true\ntools = [\"llm:*\", \"content:generate_chart@1.0.0\"]\n"
        ))
        .unwrap();
        assert_eq!(
            listed.pools["llm"]
                .tool_refs("llm")
                .unwrap()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["llm:*", "content:generate_chart@1.0.0"]
        );
        assert!(parse(MINIMAL).unwrap().pools.is_empty());
    }

    #[test]
    fn bad_pool_tables_are_refused_naming_the_key() {
        for (table, key, says) in [
            (
                "[pools.web]\ndeclard = true",
                "pools.web.declard",
                "unknown field",
            ),
            (
                "[pools.web]\ndeclared = \"yes\"",
                "pools.web.declared",
                "invalid type",
            ),
            ("[pools.web]\ntools = []", "pools.web.tools", "is empty"),
            (
                "[pools.web]\ntools = [\"web:*\", \"*\"]",
                "pools.web.tools[1]",
                "no pool serves them all",
            ),
            (
                "[pools.web]\ntools = [\"not a tool\"]",
                "pools.web.tools[0]",
                "invalid tool id",
            ),
            (
                "[pools.\"web pool\"]\ndeclared = true",
                "pools.\"web pool\"",
                "bad name",
            ),
            (
                "[pools.Web-Pool]\ndeclared = true",
                "pools.Web-Pool",
                "no tool namespace",
            ),
        ] {
            let e = parse_err(&format!("{MINIMAL}\n{table}\n"));
            assert_eq!(e.key.as_deref(), Some(key), "{table}: {e}");
            assert!(e.message.contains(says), "{table}: {e}");
            assert!(
                matches!(e.kind(), ConfigErrorKind::Parse | ConfigErrorKind::Invalid),
                "{e}"
            );
        }
        // A pool named otherwise than its namespaces lists its tools.
        parse(&format!(
            "{MINIMAL}\n[pools.Web-Pool]\ndeclared = true\ntools = [\"web:*\"]\n"
        ))
        .unwrap();
    }

    /// The example file shows the table commented out (a fleet that runs
    /// every pool declares none); uncommented, it loads.
    #[test]
    fn the_example_files_pool_table_loads_uncommented() {
        let table: String = EXAMPLE
            .lines()
            .skip_while(|l| *l != "# [pools.web]")
            .take_while(|l| l.starts_with("# "))
            .map(|l| format!("{}\n", &l[2..]))
            .collect();
        assert!(table.contains("declared = true"), "{table}");
        let config = parse(&format!("{MINIMAL}\n{table}")).unwrap();
        assert_eq!(config.declared_pools().count(), 1);
    }
}
