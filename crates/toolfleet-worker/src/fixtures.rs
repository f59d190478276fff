//! Fixtures of the crate's unit tests: a tool that answers fixed data, and
//! a definition of it with the `outputSchema` a test needs.

use std::sync::Arc;

use serde_json::{Value, json};
use toolfleet_protocol::tools::{Origin, ToolDefinition};

use crate::builder::{Served, Worker};
use crate::ctx::ToolCtx;
use crate::error::ToolError;
use crate::tool::{Tool, ToolOutput};

/// Answers its data (no data for `null`); warns first when given a
/// warning code.
pub(crate) struct Answers {
    pub(crate) data: Value,
    pub(crate) warns: Option<&'static str>,
}

impl Answers {
    pub(crate) fn data(data: Value) -> Self {
        Self { data, warns: None }
    }
}

impl Tool for Answers {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _: Value) -> Result<ToolOutput, ToolError> {
        if let Some(code) = self.warns {
            ctx.warning(code, "the tool's own warning");
        }
        if self.data.is_null() {
            return Ok(ToolOutput::text("fixed"));
        }
        ToolOutput::text("fixed").with_data(&self.data)
    }
}

/// `test:answers@1.0.0` (implementation key `test.answers`), with
/// `output_schema` when given.
pub(crate) fn definition(output_schema: Option<Value>) -> ToolDefinition {
    let mut value = json!({
        "schemaVersion": 1,
        "id": "test:answers@1.0.0",
        "implementationKey": "test.answers",
        "title": "Answers",
        "description": "Answers fixed data.",
        "category": "utility",
        "purpose": "general",
        "function": {
            "name": "answers",
            "description": "Answers fixed data.",
            "parameters": {"type": "object", "properties": {}}
        },
        "timeoutMs": 1000
    });
    if let Some(schema) = output_schema {
        value["outputSchema"] = schema;
    }
    ToolDefinition::from_value(value, Origin::Named("test".into())).unwrap()
}

/// A counted object: `{"count": <integer>}`.
pub(crate) fn counted() -> Value {
    json!({
        "type": "object",
        "properties": {"count": {"type": "integer"}},
        "required": ["count"]
    })
}

/// `tool` served for [`definition`] with `output_schema`.
pub(crate) fn served(tool: Answers, output_schema: Option<Value>) -> Arc<Served> {
    let worker = Worker::builder("test")
        .definition(definition(output_schema))
        .tool("test.answers", tool)
        .build()
        .unwrap();
    worker.tools[0].clone()
}
