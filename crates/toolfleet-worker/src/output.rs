//! The check of a tool's structured output against its definition's
//! `outputSchema` (as seed 004's runner does). A mismatch never fails the
//! call — the model still gets the answer — but the result carries an
//! `output_schema_mismatch` warning naming the first failing path, so the
//! definition and the code that disagree are found. Shared by the runtime
//! (which also logs and counts it) and [`crate::TestCtx::call_checked`].

use serde_json::Value;
use toolfleet_protocol::schema::{SchemaError, Validator, Violation};
use toolfleet_protocol::tools::ToolDefinition;

use crate::ctx::ToolCtx;

/// The warning code of an output that does not match its schema.
pub(crate) const OUTPUT_SCHEMA_MISMATCH: &str = "output_schema_mismatch";

/// A tool's `outputSchema`, compiled once (when the worker is built).
#[derive(Debug, Clone)]
pub(crate) struct OutputCheck(Validator);

impl OutputCheck {
    /// The check of `definition`'s outputs; `None` when it declares no
    /// `outputSchema`.
    pub(crate) fn of(definition: &ToolDefinition) -> Result<Option<Self>, SchemaError> {
        definition
            .output_schema
            .as_ref()
            .map(|schema| Validator::compile(schema).map(Self))
            .transpose()
    }

    /// Checks `data`, the output's structured part (an output without one
    /// has nothing to check). On a mismatch the call gets an
    /// `output_schema_mismatch` warning — unless the tool already reported
    /// one (an LLM tool checks its model's answer itself) — and the first
    /// violation is returned.
    pub(crate) fn check(&self, ctx: &ToolCtx, data: Option<&Value>) -> Option<Violation> {
        let violations = self.0.validate(data?).err()?;
        let first = violations.first()?.clone();
        if !ctx.has_warning(OUTPUT_SCHEMA_MISMATCH) {
            let more = match violations.len() - 1 {
                0 => String::new(),
                n => format!(" (and {n} more)"),
            };
            ctx.warning(
                OUTPUT_SCHEMA_MISMATCH,
                &format!("the output does not match the definition's outputSchema {first}{more}"),
            );
        }
        Some(first)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::fixtures::{Answers, counted, definition};
    use crate::testing::TestCtx;

    #[tokio::test]
    async fn an_output_that_misses_its_schema_is_answered_with_a_warning_naming_the_path() {
        let ctx = TestCtx::new();
        let tool = Answers::data(json!({"count": "three"}));
        let out = ctx
            .call_checked(&definition(Some(counted())), &tool, json!({}))
            .await
            .unwrap();
        // The answer is the tool's, untouched.
        assert_eq!(out.data, Some(json!({"count": "three"})));
        let warnings = ctx.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].code, "output_schema_mismatch");
        assert!(
            warnings[0].message.contains("at /count:"),
            "{}",
            warnings[0].message
        );
    }

    #[tokio::test]
    async fn an_output_that_matches_or_has_no_data_or_no_schema_gets_no_warning() {
        let ctx = TestCtx::new();
        for (tool, schema) in [
            (Answers::data(json!({"count": 3})), Some(counted())),
            (Answers::data(json!({"count": "three"})), None),
            (Answers::data(serde_json::Value::Null), Some(counted())),
        ] {
            ctx.call_checked(&definition(schema), &tool, json!({}))
                .await
                .unwrap();
        }
        assert!(ctx.warnings().is_empty(), "{:?}", ctx.warnings());
    }

    #[tokio::test]
    async fn a_tool_that_reported_the_mismatch_itself_gets_no_second_warning() {
        let ctx = TestCtx::new();
        let tool = Answers {
            data: json!({}),
            warns: Some("output_schema_mismatch"),
        };
        ctx.call_checked(&definition(Some(counted())), &tool, json!({}))
            .await
            .unwrap();
        let warnings = ctx.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].message, "the tool's own warning");
    }
}
