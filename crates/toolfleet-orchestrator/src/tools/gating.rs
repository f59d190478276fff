//! Gating: which tools an invocation may use at all, before any scoping.
//!
//! [`permitted`] reads one registry snapshot and the job, and returns the
//! tools the model may be offered:
//!
//! - **system tools** (`selectable: false`): added whenever their gates
//!   pass; a chat job cannot pick them;
//! - **profile tools**: the profile's `tools` — `*` and `ns:*` pick every
//!   selectable tool they cover, `ns:name` and `ns:name@x.y.z` one tool,
//!   selectable or not — and its `must_include_tools`;
//! - **selected tools**: the selectable tools the chat job names in
//!   `tools`;
//! - **agent tools** (profiles exposed as tools, from the `agents`
//!   backend) like any selectable tool, but only below the fleet's agent
//!   depth, never the invocation's own profile, and only to the tenants
//!   the agent and its profile allow.
//!
//! Every candidate then passes the gates: its **purpose**
//! (`document_processing` only with attached documents,
//! `data_source_search` only with a data source, `general` and
//! `content_generation` always), **`visibleIn`** (when not empty, it must
//! name the job's surface), **`minProviderConfidence`** (the confidence of
//! the deployment the invocation calls, 0 unless the operator set one,
//! must reach it — the same rule workers apply; a job cannot claim one)
//! and **liveness** (a tool no live worker serves is never offered, bar a
//! declared pool's, which waits for the pool's first worker:
//! [`super::declared`]). A
//! tool whose definition names `tenants` is served to those tenants only:
//! to any other it is as if no worker served it (a job naming it fails
//! with `invalid_tool_selection`, "not served", revealing nothing more).
//!
//! A job that names a tool the fleet does not serve, or one that is not
//! selectable, fails with `invalid_tool_selection` naming the entry; a
//! profile tool that is not served is left out and noted (a pool may be
//! down while the rest of the fleet works).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use toolfleet_config::Profile;
use toolfleet_protocol::ChatJob;
use toolfleet_protocol::registry::{Registry, RegistryEntry};
use toolfleet_protocol::tools::{CompiledTool, Purpose, ToolDefinition, ToolId, ToolRef};

use super::agents::AGENTS_SOURCE;
use super::declared::DECLARED_SOURCE;
use crate::Failure;
use crate::failure::ChatErrorCode;

/// Notes kept for the `scoping` event; the rest are counted.
pub const MAX_NOTES: usize = 10;

/// What an invocation brings to the gates.
#[derive(Debug, Clone)]
pub struct Gate<'a> {
    /// The job attached documents.
    pub documents: bool,
    /// The job (or its profile) names a data source.
    pub data_source: bool,
    /// Where the answer is shown (`chat`, `agent`, …).
    pub surface: &'a str,
    /// The provider confidence of the deployment in use (its
    /// `confidence`; never the job's claim).
    pub provider_confidence: f64,
    /// Whether agent tools may be offered (the job is not at the deepest
    /// nesting yet).
    pub agents: bool,
    /// The invocation's own profile, whose agent tool is never offered to
    /// itself.
    pub own_profile: &'a str,
    /// The invocation's tenant: a tool whose `tenants` leaves it out is
    /// not served to it (as if no worker served it).
    pub tenant: &'a str,
    /// Profiles whose agent tool the invocation's tenant may not use (the
    /// agent's or the profile's `tenants` leave it out): never offered.
    pub agents_denied: &'a [String],
}

/// Why a gate kept a tool out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Purpose(Purpose),
    Surface,
    Confidence,
}

impl Gate<'_> {
    /// Whether `def` passes the purpose, surface and confidence gates.
    ///
    /// # Errors
    ///
    /// The first gate that refuses it.
    pub fn admits(&self, def: &ToolDefinition) -> Result<(), Refused> {
        match def.purpose() {
            Purpose::DocumentProcessing if !self.documents => {
                return Err(Refused::Purpose(Purpose::DocumentProcessing));
            }
            Purpose::DataSourceSearch if !self.data_source => {
                return Err(Refused::Purpose(Purpose::DataSourceSearch));
            }
            _ => {}
        }
        if !def.visible_in.is_empty() && !def.visible_in.iter().any(|s| s == self.surface) {
            return Err(Refused::Surface);
        }
        if let Some(min) = def.min_provider_confidence
            && self.provider_confidence < min
        {
            return Err(Refused::Confidence);
        }
        Ok(())
    }
}

/// The tools an invocation may use.
#[derive(Debug, Clone, Default)]
pub struct Permitted {
    /// In id order, at most one per function name.
    pub tools: Vec<Arc<CompiledTool>>,
    /// Ids of the tools always offered (the profile's must-include tools),
    /// a subset of `tools`.
    pub must_include: BTreeSet<String>,
    /// What was left out and why, for the `scoping` event.
    pub notes: Vec<String>,
}

impl Permitted {
    /// The permitted tool a model calls by `function_name`.
    pub fn by_function_name(&self, function_name: &str) -> Option<&Arc<CompiledTool>> {
        self.tools
            .iter()
            .find(|t| t.definition.function.name == function_name)
    }
}

/// The tools `job` may use under `profile`, from `registry` (see the
/// module docs).
///
/// # Errors
///
/// `invalid_tool_selection` when the job names a tool the fleet does not
/// serve, or one that is not selectable.
pub fn permitted(
    registry: &Registry,
    profile: &Profile,
    job: &ChatJob,
    gate: &Gate<'_>,
) -> Result<Permitted, Failure> {
    let offerable = |e: &RegistryEntry| {
        (e.is_live() || &*e.source == DECLARED_SOURCE)
            && e.tool.definition.allows_tenant(gate.tenant)
            && if &*e.source == AGENTS_SOURCE {
                gate.agents
                    && !is_own_agent(e, gate.own_profile)
                    && !super::agents::profile_of(&e.tool)
                        .is_some_and(|p| gate.agents_denied.iter().any(|d| d == p))
            } else {
                !impersonates(e)
            }
    };
    let mut notes = Vec::new();
    let mut named = job_picks(registry, job, &offerable)?;
    let (mut must_include, patterns) =
        profile_picks(registry, profile, &offerable, &mut named, &mut notes);

    // One pass over the registry, in id order: system tools whenever their
    // gates pass, tools named above (a refusal is noted), and the
    // selectable tools the profile's patterns cover (a refusal is what the
    // gates are for: not noted).
    let mut candidates: Vec<&RegistryEntry> = Vec::new();
    for entry in registry.list() {
        let def = &entry.tool.definition;
        let why = if named.is_empty() {
            None
        } else {
            named.get(&def.id).copied()
        };
        let system = !def.selectable;
        let by_pattern = def.selectable && patterns.iter().any(|r| r.matches(&def.id));
        if (why.is_none() && !system && !by_pattern) || !offerable(entry) {
            continue;
        }
        match gate.admits(def) {
            Ok(()) => candidates.push(entry),
            Err(refused) => {
                if let Some(why) = why {
                    notes.push(format!("{} ({why}) left out: {}", def.id, explain(refused)));
                    if why == "must include" {
                        must_include.remove(&def.id.to_string());
                    }
                }
            }
        }
    }

    let tools = one_per_function_name(registry, candidates, &mut notes);
    if notes.len() > MAX_NOTES {
        let more = notes.len() - MAX_NOTES;
        notes.truncate(MAX_NOTES);
        notes.push(format!("and {more} more"));
    }
    // A must-include tool that lost a function-name clash is not offered.
    must_include.retain(|id: &String| {
        id.parse::<ToolId>()
            .is_ok_and(|id| tools.iter().any(|t| t.definition.id == id))
    });
    Ok(Permitted {
        tools,
        must_include,
        notes,
    })
}

/// The job's picks, each checked before anything else: a bad pick is the
/// client's mistake, told at once.
fn job_picks<'r>(
    registry: &'r Registry,
    job: &ChatJob,
    offerable: &dyn Fn(&RegistryEntry) -> bool,
) -> Result<HashMap<&'r ToolId, &'static str>, Failure> {
    let mut named: HashMap<&ToolId, &'static str> = HashMap::new();
    for (i, text) in job.tools.iter().enumerate() {
        let invalid = |message: String| {
            Failure::new(
                ChatErrorCode::InvalidToolSelection,
                format!("tools[{i}]: {message}"),
            )
        };
        let r: ToolRef = text.parse().map_err(|e| invalid(format!("{e}")))?;
        if r.is_pattern() {
            return Err(invalid(format!(
                "{text:?} is a pattern; a chat job picks tools by id (ns:name or ns:name@x.y.z)"
            )));
        }
        let Some(entry) = registry.resolve(&r).into_iter().find(|e| offerable(e)) else {
            return Err(invalid(format!(
                "no tool {text} is served by this fleet (no live worker serves it)"
            )));
        };
        if !entry.tool.definition.selectable {
            return Err(invalid(format!(
                "{} is a system tool: it cannot be picked (it is added when its purpose applies)",
                entry.tool.definition.id
            )));
        }
        named.insert(&entry.tool.definition.id, "selected");
    }
    Ok(named)
}

/// The profile's tools by name, and its must-include tools, into `named`
/// (each a lookup); returns the must-include ids and the profile's
/// patterns, which the one pass over the registry matches.
fn profile_picks<'r, 'p>(
    registry: &'r Registry,
    profile: &'p Profile,
    offerable: &dyn Fn(&RegistryEntry) -> bool,
    named: &mut HashMap<&'r ToolId, &'static str>,
    notes: &mut Vec<String>,
) -> (BTreeSet<String>, Vec<&'p ToolRef>) {
    let mut must_include = BTreeSet::new();
    let mut patterns: Vec<&ToolRef> = Vec::new();
    for r in &profile.tools {
        if r.is_pattern() {
            patterns.push(r);
            continue;
        }
        match registry.resolve(r).into_iter().find(|e| offerable(e)) {
            Some(entry) => {
                named.entry(&entry.tool.definition.id).or_insert("profile");
            }
            None => notes.push(format!("profile tool {r} is not served by any live worker")),
        }
    }
    for id in &profile.must_include_tools {
        match registry.get_id(id).filter(|e| offerable(e)) {
            Some(entry) => {
                named.insert(&entry.tool.definition.id, "must include");
                must_include.insert(id.to_string());
            }
            None => notes.push(format!(
                "must-include tool {id} is not served by any live worker"
            )),
        }
    }
    (must_include, patterns)
}

/// Whether a tool from a worker (not the agents backend) looks like one of
/// the orchestrator's own: the `agent` namespace, an `agent.`
/// implementation key (what makes a call a nested chat job), or the
/// `search_tools` meta-tool's function name. Never offered: a worker must
/// not get around the agent depth cap, run a profile, or shadow the
/// meta-tool.
fn impersonates(entry: &RegistryEntry) -> bool {
    let def = &entry.tool.definition;
    def.id.namespace == "agent"
        || super::agents::profile_of(&entry.tool).is_some()
        || def.function.name == super::scoring::SEARCH_TOOLS
}

/// Whether `entry` is the agent tool of profile `profile`.
fn is_own_agent(entry: &RegistryEntry, profile: &str) -> bool {
    entry.tool.definition.implementation_key == super::agents::implementation_key(profile)
}

fn explain(refused: Refused) -> &'static str {
    match refused {
        Refused::Purpose(Purpose::DocumentProcessing) => {
            "document_processing, and no documents are attached"
        }
        Refused::Purpose(Purpose::DataSourceSearch) => {
            "data_source_search, and no data source is attached"
        }
        Refused::Purpose(_) => "its purpose does not apply",
        Refused::Surface => "not visible on this surface (visibleIn)",
        Refused::Confidence => "the provider confidence is below its minProviderConfidence",
    }
}

/// A model must never see one function name twice: of candidates sharing
/// one, the one the registry offers for that name wins, else the smallest
/// id; the others are noted.
fn one_per_function_name(
    registry: &Registry,
    candidates: Vec<&RegistryEntry>,
    notes: &mut Vec<String>,
) -> Vec<Arc<CompiledTool>> {
    if registry.function_names_unique() {
        return candidates.into_iter().map(|e| e.tool.clone()).collect();
    }
    // Function name → position in `kept`; clashes are rare, so the common
    // case is one hash insert per tool and no reordering.
    let mut first: HashMap<&str, usize> = HashMap::with_capacity(candidates.len());
    let mut kept: Vec<Option<&RegistryEntry>> = Vec::with_capacity(candidates.len());
    let mut clashes: Vec<(usize, &RegistryEntry)> = Vec::new();
    for entry in candidates {
        let name = entry.tool.definition.function.name.as_str();
        match first.get(name) {
            Some(&at) => clashes.push((at, entry)),
            None => {
                first.insert(name, kept.len());
                kept.push(Some(entry));
            }
        }
    }
    let clashed = !clashes.is_empty();
    for (at, other) in clashes {
        let Some(current) = kept[at] else { continue };
        let name = current.tool.definition.function.name.as_str();
        let preferred = registry
            .by_function_name(name)
            .map(|e| &e.tool.definition.id);
        let (a, b) = (&current.tool.definition.id, &other.tool.definition.id);
        // The registry's pick when it is here; else the smallest ns:name,
        // at its highest version.
        let other_wins = if Some(b) == preferred {
            true
        } else if Some(a) == preferred {
            false
        } else {
            (&b.namespace, &b.name, std::cmp::Reverse(b.version))
                < (&a.namespace, &a.name, std::cmp::Reverse(a.version))
        };
        let (winner, loser) = if other_wins {
            (other, current)
        } else {
            (current, other)
        };
        kept[at] = Some(winner);
        let (w, l) = (&winner.tool.definition.id, &loser.tool.definition.id);
        // An older version of the same tool is no news.
        if (&w.namespace, &w.name) != (&l.namespace, &l.name) {
            notes.push(format!(
                "{l} left out: {w} is offered under the same function name {name:?}"
            ));
        }
    }
    let mut tools: Vec<Arc<CompiledTool>> =
        kept.into_iter().flatten().map(|e| e.tool.clone()).collect();
    if clashed {
        // A clash's winner may sit at the loser's place: back to id order.
        tools.sort_by(|a, b| a.definition.id.cmp(&b.definition.id));
    }
    tools
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use toolfleet_protocol::registry::{SourcedTool, ToolSource};
    use toolfleet_protocol::tools::Origin;

    struct Source(&'static str, Vec<SourcedTool>);

    impl ToolSource for Source {
        fn name(&self) -> &str {
            self.0
        }
        fn tools(&self) -> Vec<SourcedTool> {
            self.1.clone()
        }
    }

    fn tool(id: &str, function: &str, extra: Value) -> Arc<CompiledTool> {
        let (ns_name, _) = id.split_once('@').unwrap();
        let key = ns_name.replace(':', ".");
        let mut v = json!({
            "schemaVersion": 1, "id": id, "implementationKey": key, "title": id,
            "description": "d", "category": "c",
            "function": { "name": function, "description": "d",
                          "parameters": { "type": "object", "properties": {} } }
        });
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        Arc::new(
            CompiledTool::new(ToolDefinition::from_value(v, Origin::Named(id.into())).unwrap())
                .unwrap(),
        )
    }

    fn live(t: Arc<CompiledTool>) -> SourcedTool {
        SourcedTool {
            tool: t,
            workers: 1,
            families: vec![],
        }
    }

    fn gate() -> Gate<'static> {
        Gate {
            documents: false,
            data_source: false,
            surface: "chat",
            provider_confidence: 0.0,
            agents: true,
            own_profile: "default",
            tenant: "acme",
            agents_denied: &[],
        }
    }

    fn ids(p: &Permitted) -> Vec<String> {
        p.tools
            .iter()
            .map(|t| t.definition.id.to_string())
            .collect()
    }

    #[test]
    fn a_definition_passes_only_the_gates_its_invocation_opens() {
        let g = gate();
        let doc = tool(
            "t:doc@1.0.0",
            "doc",
            json!({"purpose": "document_processing"}),
        );
        let src = tool(
            "t:src@1.0.0",
            "src",
            json!({"purpose": "data_source_search"}),
        );
        let generate = tool(
            "t:gen@1.0.0",
            "gen",
            json!({"purpose": "content_generation"}),
        );
        let vis = tool("t:vis@1.0.0", "vis", json!({"visibleIn": ["mobile"]}));
        let conf = tool(
            "t:conf@1.0.0",
            "conf",
            json!({"minProviderConfidence": 0.5}),
        );
        assert_eq!(
            g.admits(&doc.definition),
            Err(Refused::Purpose(Purpose::DocumentProcessing))
        );
        assert_eq!(
            g.admits(&src.definition),
            Err(Refused::Purpose(Purpose::DataSourceSearch))
        );
        assert_eq!(g.admits(&generate.definition), Ok(()));
        assert_eq!(g.admits(&vis.definition), Err(Refused::Surface));
        assert_eq!(g.admits(&conf.definition), Err(Refused::Confidence));
        let open = Gate {
            documents: true,
            data_source: true,
            surface: "mobile",
            provider_confidence: 0.5,
            ..gate()
        };
        for t in [&doc, &src, &generate, &vis, &conf] {
            assert_eq!(open.admits(&t.definition), Ok(()), "{}", t.definition.id);
        }
    }

    #[test]
    fn system_profile_selected_and_agent_tools_and_their_errors() {
        let catalog = Source(
            "catalog",
            vec![
                live(tool("t:a@1.0.0", "a", json!({}))),
                live(tool("t:b@1.0.0", "b", json!({}))),
                live(tool("t:sys@1.0.0", "sys", json!({"selectable": false}))),
                live(tool("u:c@1.0.0", "c", json!({}))),
                // Known, not served: never offered.
                SourcedTool::known(tool("u:dead@1.0.0", "dead", json!({}))),
            ],
        );
        let agents = Source(
            AGENTS_SOURCE,
            vec![
                live(tool(
                    "agent:helper@1.0.0",
                    "helper",
                    json!({"implementationKey": "agent.helper_profile"}),
                )),
                live(tool(
                    "agent:me@1.0.0",
                    "me",
                    json!({"implementationKey": "agent.default"}),
                )),
            ],
        );
        let registry = Registry::build(&[&agents as &dyn ToolSource, &catalog]);
        let mut profile = toolfleet_config::Profile::new("d");
        let job = toolfleet_protocol::client::question("hi");

        // `*`: every selectable live tool, the system tool, agents but not
        // the profile's own.
        let all = permitted(&registry, &profile, &job, &gate()).unwrap();
        assert_eq!(
            ids(&all),
            [
                "agent:helper@1.0.0",
                "t:a@1.0.0",
                "t:b@1.0.0",
                "t:sys@1.0.0",
                "u:c@1.0.0"
            ]
        );
        // At the depth cap: no agent tool.
        let deep = permitted(
            &registry,
            &profile,
            &job,
            &Gate {
                agents: false,
                ..gate()
            },
        )
        .unwrap();
        assert!(!ids(&deep).iter().any(|i| i.starts_with("agent:")));
        // An agent the tenant may not use: never offered, nor picked.
        let denied = ["helper_profile".to_owned()];
        let other_tenant = Gate {
            agents_denied: &denied,
            ..gate()
        };
        let theirs = permitted(&registry, &profile, &job, &other_tenant).unwrap();
        assert!(!ids(&theirs).iter().any(|i| i.starts_with("agent:")));
        let mut pick_agent = job.clone();
        pick_agent.tools = vec!["agent:helper".into()];
        assert!(permitted(&registry, &profile, &pick_agent, &other_tenant).is_err());
        assert!(permitted(&registry, &profile, &pick_agent, &gate()).is_ok());

        // A narrow profile, a must-include tool, and a job's pick.
        profile.tools = vec!["u:*".parse().unwrap(), "u:dead".parse().unwrap()];
        profile.must_include_tools = vec!["t:a@1.0.0".parse().unwrap()];
        let mut picking = job.clone();
        picking.tools = vec!["t:b".into()];
        let narrow = permitted(&registry, &profile, &picking, &gate()).unwrap();
        assert_eq!(
            ids(&narrow),
            ["t:a@1.0.0", "t:b@1.0.0", "t:sys@1.0.0", "u:c@1.0.0"]
        );
        assert!(narrow.must_include.contains("t:a@1.0.0"));
        assert!(
            narrow.notes.iter().any(|n| n.contains("u:dead")),
            "{:?}",
            narrow.notes
        );

        for (pick, says) in [
            ("t:sys", "system tool"),
            ("u:dead", "no tool u:dead"),
            ("t:*", "pattern"),
            ("nope", "tools[0]"),
        ] {
            let mut bad = job.clone();
            bad.tools = vec![pick.into()];
            let e = permitted(&registry, &profile, &bad, &gate()).unwrap_err();
            assert_eq!(e.code, "invalid_tool_selection");
            assert!(
                e.message.contains(says) && e.message.starts_with("tools[0]"),
                "{pick}: {}",
                e.message
            );
        }
    }

    #[test]
    fn a_tool_for_other_tenants_is_not_served_to_this_one() {
        let catalog = Source(
            "catalog",
            vec![
                live(tool("t:open@1.0.0", "open", json!({}))),
                live(tool("t:star@1.0.0", "star", json!({"tenants": ["*"]}))),
                live(tool(
                    "t:theirs@1.0.0",
                    "theirs",
                    json!({"tenants": ["globex"]}),
                )),
            ],
        );
        let registry = Registry::build(&[&catalog as &dyn ToolSource]);
        let profile = toolfleet_config::Profile::new("d");
        let job = toolfleet_protocol::client::question("hi");
        let acme = permitted(&registry, &profile, &job, &gate()).unwrap();
        assert_eq!(ids(&acme), ["t:open@1.0.0", "t:star@1.0.0"]);
        let globex = Gate {
            tenant: "globex",
            ..gate()
        };
        let theirs = permitted(&registry, &profile, &job, &globex).unwrap();
        assert_eq!(
            ids(&theirs),
            ["t:open@1.0.0", "t:star@1.0.0", "t:theirs@1.0.0"]
        );
        // Named by acme: "not served", like a tool nobody serves.
        let mut naming = job.clone();
        naming.tools = vec!["t:theirs".into()];
        let e = permitted(&registry, &profile, &naming, &gate()).unwrap_err();
        assert_eq!(e.code, "invalid_tool_selection");
        assert!(
            e.message.contains("no tool t:theirs is served"),
            "{}",
            e.message
        );
    }

    #[test]
    fn one_tool_per_function_name_is_permitted() {
        let catalog = Source(
            "catalog",
            vec![
                live(tool("t:x@1.0.0", "same", json!({}))),
                live(tool("t:x@2.0.0", "same", json!({}))),
                // The registry's pick for "same", kept out by a gate: the
                // next highest version stands in, not the lowest.
                live(tool("t:x@3.0.0", "same", json!({"visibleIn": ["mobile"]}))),
                live(tool("u:y@1.0.0", "same", json!({}))),
                // Workers posing as the orchestrator's own tools.
                live(tool("agent:fake@1.0.0", "fake", json!({}))),
                live(tool(
                    "w:sneaky@1.0.0",
                    "sneaky",
                    json!({"implementationKey": "agent.default"}),
                )),
                live(tool("w:search@1.0.0", "search_tools", json!({}))),
            ],
        );
        let registry = Registry::build(&[&catalog as &dyn ToolSource]);
        let profile = toolfleet_config::Profile::new("d");
        let job = toolfleet_protocol::client::question("hi");
        let p = permitted(&registry, &profile, &job, &gate()).unwrap();
        assert_eq!(ids(&p), ["t:x@2.0.0"], "the newest version of the first id");
        // The other tool is noted; the older version of the same one is not.
        assert_eq!(p.notes.len(), 1, "{:?}", p.notes);
        assert!(
            p.notes[0].starts_with("u:y@1.0.0 left out"),
            "{:?}",
            p.notes
        );
    }
}
