//! toolfleet-worker-system: the `system:*` tools, bound to their definition
//! files by `implementationKey`. Written against the worker SDK alone.
//!
//! - `system.current_datetime` ([`CurrentDatetime`]): the current date and
//!   time, in UTC or at a given offset.

use std::path::Path;

use serde::Deserialize;
use serde_json::json;
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker, WorkerError};

/// The family name (the worker's name in the catalog and services API).
pub const FAMILY: &str = "system";

/// The system worker: every definition in `definitions` whose
/// `implementationKey` is one of this family's.
///
/// # Errors
///
/// [`WorkerError::Config`] when a definition is missing or invalid.
pub fn worker(definitions: &Path) -> Result<Worker, WorkerError> {
    Worker::builder(FAMILY)
        .definitions_dir(definitions)
        .tool("system.current_datetime", CurrentDatetime)
        .build()
}

/// `system.current_datetime`.
pub struct CurrentDatetime;

/// Arguments of [`CurrentDatetime`].
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DatetimeArgs {
    /// `+HH:MM` or `-HH:MM`; UTC when absent.
    pub utc_offset: Option<String>,
}

fn parse_offset(s: &str) -> Result<time::UtcOffset, ToolError> {
    let format = time::macros::format_description!("[offset_hour sign:mandatory]:[offset_minute]");
    time::UtcOffset::parse(s, &format)
        .map_err(|e| ToolError::InvalidInput(format!("utcOffset {s:?} is not like +02:00: {e}")))
}

impl CurrentDatetime {
    /// The answer at `now` (a pure function, for tests).
    ///
    /// # Errors
    ///
    /// [`ToolError::InvalidInput`] for an offset that does not parse.
    pub fn at(now: time::OffsetDateTime, args: &DatetimeArgs) -> Result<ToolOutput, ToolError> {
        let offset = match &args.utc_offset {
            Some(s) => parse_offset(s)?,
            None => time::UtcOffset::UTC,
        };
        let local = now.to_offset(offset);
        let iso = local
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| ToolError::failed(e.to_string()))?;
        let weekday = local.weekday().to_string();
        let shown_offset = match &args.utc_offset {
            Some(s) if !offset.is_utc() => s.clone(),
            _ => "+00:00".to_string(),
        };
        ToolOutput::text(format!("{iso} ({weekday})")).with_data(json!({
            "iso": iso,
            "weekday": weekday,
            "unixMs": (now.unix_timestamp_nanos() / 1_000_000) as i64,
            "utcOffset": shown_offset,
        }))
    }
}

impl Tool for CurrentDatetime {
    type Args = DatetimeArgs;

    async fn call(&self, _ctx: &ToolCtx, args: DatetimeArgs) -> Result<ToolOutput, ToolError> {
        Self::at(time::OffsetDateTime::now_utc(), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_worker::TestCtx;
    use toolfleet_worker::protocol::schema::{Validator, describe};

    fn args(offset: Option<&str>) -> DatetimeArgs {
        DatetimeArgs {
            utc_offset: offset.map(str::to_string),
        }
    }

    #[test]
    fn datetime_in_utc_and_at_an_offset() {
        let now = time::macros::datetime!(2026-11-21 22:50:00 UTC);
        let out = CurrentDatetime::at(now, &args(None)).unwrap();
        assert_eq!(out.content, "2026-11-21T22:50:00Z (Saturday)");
        let out = CurrentDatetime::at(now, &args(Some("+05:30"))).unwrap();
        assert_eq!(out.content, "2026-11-22T04:20:00+05:30 (Sunday)");
        assert_eq!(out.data.unwrap()["utcOffset"], "+05:30");
        assert!(matches!(
            CurrentDatetime::at(now, &args(Some("25:00"))),
            Err(ToolError::InvalidInput(_))
        ));
    }

    fn shipped_definitions() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions")
    }

    #[test]
    fn the_worker_binds_the_shipped_definition() {
        let worker = worker(&shipped_definitions()).unwrap();
        let ids: Vec<String> = worker.definitions().map(|d| d.id.to_string()).collect();
        assert_eq!(ids, ["system:current_datetime@1.0.0"]);
        let err = super::worker(Path::new("/nonexistent")).unwrap_err();
        assert!(matches!(err, WorkerError::Config(_)), "{err}");
    }

    /// Every system tool, run as a worker runs it, answers what its
    /// definition's `outputSchema` describes (each has one): no
    /// `output_schema_mismatch` warning, and the data validates.
    #[tokio::test]
    async fn every_system_tool_answers_as_its_output_schema_says() {
        let worker = worker(&shipped_definitions()).unwrap();
        for def in worker.definitions() {
            let schema = def
                .output_schema
                .as_ref()
                .unwrap_or_else(|| panic!("{} has no outputSchema", def.id));
            let validator = Validator::compile(schema).unwrap();
            let ctx = TestCtx::new();
            let outputs = match def.implementation_key.as_str() {
                "system.current_datetime" => vec![
                    ctx.call_checked(def, &CurrentDatetime, json!({})).await,
                    ctx.call_checked(def, &CurrentDatetime, json!({"utcOffset": "-05:30"}))
                        .await,
                ],
                other => panic!("no case for {other}: add the tool's calls here"),
            };
            for output in outputs {
                let output = output.unwrap_or_else(|e| panic!("{}: {e}", def.id));
                let data = output
                    .data
                    .unwrap_or_else(|| panic!("{}: no structured output", def.id));
                if let Err(violations) = validator.validate(&data) {
                    panic!("{}: {data} misses: {}", def.id, describe(&violations));
                }
            }
            assert!(
                ctx.warnings().is_empty(),
                "{}: {:?}",
                def.id,
                ctx.warnings()
            );
        }
    }

    #[tokio::test]
    async fn the_schema_is_checked_before_the_tool_runs() {
        let def = toolfleet_worker::protocol::tools::load_file(
            shipped_definitions().join("system.current_datetime.json"),
        )
        .unwrap();
        let ctx = TestCtx::new();
        let ok = ctx
            .call_checked(&def, &CurrentDatetime, json!({"utcOffset": "+01:00"}))
            .await
            .unwrap();
        assert!(ok.content.contains("+01:00"), "{}", ok.content);
        let bad = ctx
            .call_checked(&def, &CurrentDatetime, json!({"utcOffset": "noon"}))
            .await
            .unwrap_err();
        match bad {
            ToolError::InvalidInput(m) => assert!(m.contains("utcOffset"), "{m}"),
            other => panic!("expected invalid input, got {other:?}"),
        }
    }
}
