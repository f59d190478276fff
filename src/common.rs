//! What several commands share: the `--output` format, text cut to one
//! line, loading the tool definitions, and the checks of the ids and
//! tenants an operator types. The bottom of this package: it imports none
//! of its modules.

use anyhow::Context;

/// How a command prints its result.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A table (or lines) for people.
    #[value(alias = "table")]
    Text,
    /// JSON for programs.
    Json,
}

/// `text` on one line (control characters as spaces), cut to `max`
/// characters with `…`.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Loads and validates the tool definition files in `dir`.
pub(crate) fn load_registry(
    dir: &std::path::Path,
) -> anyhow::Result<toolfleet_protocol::tools::ToolRegistry> {
    toolfleet_protocol::tools::ToolRegistry::from_dir(dir)
        .with_context(|| format!("loading tool definitions from {}", dir.display()))
}

/// Whether `tenant` is a valid tenant; when it is not, says so on stderr
/// as `command` (e.g. `toolfleet chat`) and the caller exits with
/// [`toolfleet_service::args::EXIT_CONFIG`].
pub(crate) fn tenant_ok(command: &str, tenant: &str) -> bool {
    let ok = toolfleet_protocol::valid_tenant(tenant);
    if !ok {
        eprintln!("{command}: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
    }
    ok
}

/// Whether `id` is a valid invocation id; when it is not, says so on
/// stderr as `command`, as [`tenant_ok`] does.
pub(crate) fn invocation_ok(command: &str, id: &str) -> bool {
    let ok = toolfleet_protocol::valid_invocation_id(id);
    if !ok {
        eprintln!("{command}: {id:?} is not an invocation id");
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_flattens_and_cuts() {
        assert_eq!(one_line("a\nb", 10), "a b");
        assert_eq!(one_line("abcdef", 4), "abc…");
        assert_eq!(one_line("abcd", 4), "abcd");
    }
}
