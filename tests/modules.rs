//! The module graph inside each crate (ARCHITECTURE.md's invariants),
//! checked on the sources: no import circle among the files of any crate,
//! and the orchestrator's stages import only the stages after them, the
//! parts and the shared types below them.
//!
//! A file is a module (`a/b.rs` and `a/b/mod.rs` are `a::b`). Its imports
//! are the paths it names after `crate::` and `super::` (`use` lists
//! included), a name re-exported at the crate root counting as the module
//! it comes from. A module naming its own ancestor (`super::X` from a
//! child) is its face, not an import. Test modules at the end of a file
//! (`#[cfg(test)] mod tests`) are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::support;

/// Every crate's `src/` of the workspace.
fn crate_sources() -> Vec<PathBuf> {
    let root = support::root();
    let mut dirs = vec![root.join("src"), root.join("examples/units/src")];
    for group in ["crates", "workers"] {
        let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(group))
            .unwrap()
            .map(|e| e.unwrap().path().join("src"))
            .filter(|p| p.is_dir())
            .collect();
        found.sort();
        dirs.extend(found);
    }
    dirs
}

/// The modules of a crate: path (`a::b`; the root is `""`) to source.
fn modules(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, src: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, src, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            out.insert(parts.join("::"), strip(&text));
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

/// The source without comments and without its trailing test module.
fn strip(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |n| &after[n..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |n| &after[n + 2..]);
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths named after `prefix` (e.g. `crate::`), with `{a, b::c}`
/// lists expanded one level: `a`, `b::c`.
fn paths_after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(found) = text[at..].find(prefix) {
        let start = at + found;
        at = start + prefix.len();
        if start > 0 && text[..start].ends_with(|c: char| is_ident(c) || c == ':') {
            continue;
        }
        let rest = &text[at..];
        if let Some(list) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in list.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 && (is_ident(c) || c == ':') {
                    item.push(c);
                }
            }
            out.push(item);
        } else {
            let path: String = rest
                .chars()
                .take_while(|&c| is_ident(c) || c == ':')
                .collect();
            out.push(path);
        }
    }
    out.into_iter()
        .map(|p| p.trim_end_matches(':').to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// The root's re-exports: a name to the module it comes from.
fn reexports(root: &str, mods: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in root.lines().map(str::trim) {
        let Some(used) = line
            .strip_prefix("pub use ")
            .or_else(|| line.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let used = used.trim_end_matches(';');
        let (base, names) = match used.split_once("::{") {
            Some((base, names)) => (base.to_string(), names.trim_end_matches('}').to_string()),
            None => match used.rsplit_once("::") {
                Some((base, name)) => (base.to_string(), name.to_string()),
                None => continue,
            },
        };
        let base = base.trim_start_matches("crate::").to_string();
        if !mods.contains_key(&base) {
            continue;
        }
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let name = name.rsplit(" as ").next().unwrap().trim();
            out.insert(name.to_string(), base.clone());
        }
    }
    out
}

/// The longest module `path` names, relative to the root.
fn module_of(
    path: &str,
    mods: &BTreeMap<String, String>,
    reexported: &BTreeMap<String, String>,
) -> Option<String> {
    let segments: Vec<&str> = path.split("::").collect();
    for k in (1..=segments.len()).rev() {
        let candidate = segments[..k].join("::");
        if mods.contains_key(&candidate) {
            return Some(candidate);
        }
    }
    reexported.get(segments[0]).cloned()
}

/// Each module's imports of other modules of the crate.
fn imports(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let root = mods.get("").cloned().unwrap_or_default();
    let reexported = reexports(&root, mods);
    let mut edges = BTreeMap::new();
    for (m, text) in mods {
        let mut to = BTreeSet::new();
        for path in paths_after(text, "crate::") {
            if let Some(target) = module_of(&path, mods, &reexported) {
                to.insert(target);
            }
        }
        // `super::` from `a::b` names `a`'s children; `super::super::`,
        // the grandparent's.
        let parent: Vec<&str> = if m.is_empty() {
            Vec::new()
        } else {
            let mut p: Vec<&str> = m.split("::").collect();
            p.pop();
            p
        };
        for path in paths_after(text, "super::") {
            let mut base = parent.clone();
            let mut rest = path.as_str();
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            let full = base
                .iter()
                .copied()
                .chain(rest.split("::"))
                .collect::<Vec<_>>()
                .join("::");
            if let Some(target) = module_of(&full, mods, &BTreeMap::new()) {
                to.insert(target);
            }
        }
        // A module naming itself or an ancestor: its own face.
        to.retain(|t| t != m && !(t.is_empty() || m.starts_with(&format!("{t}::"))));
        edges.insert(m.clone(), to);
    }
    edges
}

/// The import circles among `edges` (strongly connected components of
/// more than one module).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn no_crate_has_an_import_circle_among_its_files() {
    let mut found = Vec::new();
    for src in crate_sources() {
        let edges = imports(&modules(&src));
        for circle in circles(&edges) {
            found.push(format!("{}: {}", src.display(), circle.join(" ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The orchestrator's modules by rank: a module imports only modules of a
/// higher rank (further down the flow), its own group's, or — among the
/// shared ones — any shared one.
const ORCHESTRATOR_RANKS: &[(&str, u32)] = &[
    ("start", 1),
    ("config", 2),
    // The stages, in the order an invocation goes through them.
    ("intake", 3),
    ("context", 4),
    ("rounds", 5),
    ("dispatch", 6),
    // The parts the stages call.
    ("approvals", 7),
    ("agents", 7),
    ("pools", 7),
    ("sinks::relay", 7),
    // The last stage, which every stage and part publishes through.
    ("events", 8),
];

/// Every other module of the orchestrator is shared, below them all.
const SHARED: u32 = 10;

fn rank_of(module: &str) -> (u32, &str) {
    ORCHESTRATOR_RANKS
        .iter()
        .filter(|(prefix, _)| module == *prefix || module.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, _)| prefix.len())
        .map_or((SHARED, "shared"), |(prefix, rank)| (*rank, *prefix))
}

#[test]
fn the_orchestrators_stages_read_in_one_direction() {
    let src = support::root().join("crates/toolfleet-orchestrator/src");
    let mods = modules(&src);
    for stage in [
        "intake",
        "context",
        "rounds",
        "dispatch",
        "events",
        "approvals",
    ] {
        assert!(mods.contains_key(stage), "no module {stage}");
    }
    let edges = imports(&mods);
    let mut upward = Vec::new();
    for (from, targets) in edges.iter().filter(|(m, _)| !m.is_empty() && *m != "main") {
        let (from_rank, from_group) = rank_of(from);
        for to in targets {
            let (to_rank, to_group) = rank_of(to);
            let allowed = to_rank > from_rank
                || (to_rank == from_rank && (from_group == to_group || from_rank == SHARED));
            if !allowed {
                upward.push(format!("{from} -> {to}"));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the flow (a stage may import only the stages after it, the parts and the shared types):\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_graph_reader_sees_use_lists_reexports_and_super() {
    let mods: BTreeMap<String, String> = [
        ("", "pub mod a;\npub mod b;\npub use b::Thing;\n"),
        ("a", "use crate::{Thing, b::inner};\nuse super::c::X;\n"),
        ("a::child", "use super::Face; // crate::b::commented\n"),
        ("b", "pub struct Thing;\n"),
        ("b::inner", ""),
        ("c", "use crate::a::child;\n"),
    ]
    .into_iter()
    .map(|(m, t)| (m.to_string(), strip(t)))
    .collect();
    let edges = imports(&mods);
    assert_eq!(edges["a"], ["b", "b::inner", "c"].map(String::from).into());
    assert!(edges["a::child"].is_empty(), "{:?}", edges["a::child"]);
    assert_eq!(edges["c"], ["a::child"].map(String::from).into());
    let mut with_circle = edges.clone();
    with_circle.insert("b".into(), ["c".to_string()].into());
    with_circle.insert("a::child".into(), ["b".to_string()].into());
    assert_eq!(circles(&with_circle), [vec!["a::child", "b", "c"]]);
}
