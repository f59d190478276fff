//! A worker's NATS role: the permissions block `ops/nats/auth.conf` gives
//! its family, written from the tools it actually serves. The shipped
//! families' blocks are this output (a test compares them); a family whose
//! tools depend on its configuration (the MCP worker) prints its own with
//! `--print-nats-role`.

use std::collections::BTreeSet;
use std::fmt::Write;

use toolfleet_protocol::{Subjects, ToolId};

use crate::Worker;

/// The permissions block of `worker`'s role under `subjects`' prefix:
/// `<STEM>_<FAMILY> = { publish …, subscribe …, allow_responses }`, for a
/// user whose inbox prefix is `_INBOX.worker.<family>`. Per tool: its
/// consumer's info, create (pinned to the tool's subject), pull and acks;
/// per namespace: its catalog keys and direct endpoints.
pub fn nats_role(worker: &Worker, subjects: &Subjects) -> String {
    let ids: Vec<ToolId> = worker.definitions().map(|d| d.id.clone()).collect();
    family_role(worker.name(), ids, subjects)
}

/// The permissions block of family `family` serving the tools `ids`.
pub fn family_role(family: &str, mut ids: Vec<ToolId>, subjects: &Subjects) -> String {
    let tools_stream = subjects.tools_stream();
    let stem = tools_stream.strip_suffix("_TOOLS").unwrap_or(&tools_stream);
    let catalog = subjects.catalog_bucket();
    let service = subjects.worker_service();
    let prefix = subjects.prefix();
    ids.sort_by_key(ToString::to_string);
    ids.dedup();
    let namespaces: BTreeSet<&str> = ids.iter().map(|id| id.namespace.as_str()).collect();

    let mut publish = vec![
        subjects.replies_all(),
        subjects.dead_letter(toolfleet_protocol::DeadLetterKind::Tool),
        "$JS.API.INFO".to_string(),
        format!("$JS.API.STREAM.INFO.{tools_stream}"),
        format!("$JS.API.STREAM.CREATE.{tools_stream}"),
        format!("$JS.API.STREAM.INFO.KV_{catalog}"),
        format!("$JS.API.STREAM.CREATE.KV_{catalog}"),
    ];
    for id in &ids {
        let consumer = subjects.tool_consumer(id);
        publish.push(format!("$JS.API.CONSUMER.INFO.{tools_stream}.{consumer}"));
        publish.push(format!(
            "$JS.API.CONSUMER.CREATE.{tools_stream}.{consumer}.{}",
            subjects.tool(id)
        ));
        publish.push(format!(
            "$JS.API.CONSUMER.MSG.NEXT.{tools_stream}.{consumer}"
        ));
        publish.push(format!("$JS.ACK.{tools_stream}.{consumer}.>"));
    }
    publish.extend(namespaces.iter().map(|ns| format!("$KV.{catalog}.{ns}.>")));

    let mut subscribe = vec![
        subjects.chat_cancel_any(),
        "$SRV.*".to_string(),
        format!("$SRV.*.{service}"),
        format!("$SRV.*.{service}.*"),
    ];
    subscribe.extend(
        namespaces
            .iter()
            .map(|ns| format!("{prefix}.direct.{ns}.>")),
    );
    subscribe.push(format!("_INBOX.worker.{family}.>"));

    let name = format!("{stem}_{}", family.to_ascii_uppercase().replace('-', "_"));
    let mut out = format!("{name} = {{\n  publish = {{\n    allow = [\n");
    for subject in &publish {
        let _ = writeln!(out, "      \"{subject}\",");
    }
    out.push_str("    ]\n  }\n  subscribe = {\n    allow = [\n");
    for subject in &subscribe {
        let _ = writeln!(out, "      \"{subject}\",");
    }
    out.push_str("    ]\n  }\n  allow_responses = true\n}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{Answers, definition};

    /// The fixture's definition as `mcp_notes:<name>@1.0.0`.
    fn notes(name: &str) -> toolfleet_protocol::tools::ToolDefinition {
        let mut def = definition(None);
        def.id = format!("mcp_notes:{name}@1.0.0").parse().unwrap();
        def.function.name = format!("mcp_notes_{name}");
        def
    }

    #[test]
    fn a_role_names_each_tool_and_namespace_once() {
        let worker = Worker::builder("mcp")
            .definition(notes("read"))
            .definition(notes("write"))
            .tool("test.answers", Answers::data(serde_json::Value::Null))
            .build()
            .unwrap();
        let role = nats_role(&worker, &Subjects::new("toolfleet").unwrap());
        assert!(role.starts_with("TOOLFLEET_MCP = {\n"), "{role}");
        assert!(role.contains(
            "\"$JS.API.CONSUMER.CREATE.TOOLFLEET_TOOLS.tool_mcp_notes_write_1_0_0.toolfleet.tool.mcp_notes.write.1_0_0\""
        ), "{role}");
        assert_eq!(
            role.matches("tool_mcp_notes_read_1_0_0").count(),
            4,
            "{role}"
        );
        assert_eq!(role.matches("$KV.TOOLFLEET_CATALOG.mcp_notes.>").count(), 1);
        assert_eq!(role.matches("toolfleet.direct.mcp_notes.>").count(), 1);
        assert!(role.contains("\"_INBOX.worker.mcp.>\""), "{role}");
    }

    /// The shipped `ops/nats/mcp-role.conf` is the role of an MCP pool
    /// with no tool (what an operator replaces with the worker's own).
    #[test]
    fn the_shipped_mcp_role_serves_no_tool() {
        let shipped = include_str!("../../../ops/nats/mcp-role.conf");
        let body: Vec<&str> = shipped.lines().filter(|l| !l.starts_with('#')).collect();
        let role = family_role("mcp", Vec::new(), &Subjects::new("toolfleet").unwrap());
        assert_eq!(body.join("\n"), role.trim_end());
    }
}
