//! units-worker: a small third-party toolfleet worker, written against the
//! worker SDK (`toolfleet-worker`) alone. It serves one tool,
//! `units:convert@1.0.0` (`tool_definitions/units.convert.json`), which
//! converts quantities between units and cites the conversion factor it
//! used, so its answers carry a `[doc:N]` reference like any fleet tool.

use std::path::Path;

use serde::Deserialize;
use serde_json::json;
use toolfleet_worker::{NewReference, Tool, ToolCtx, ToolError, ToolOutput, Worker, WorkerError};

/// The worker's name in the fleet's catalog.
pub const NAME: &str = "units";

/// The tool's definition, carried in the binary.
pub const DEFINITION: &str = include_str!("../tool_definitions/units.convert.json");

/// The implementation key of [`Convert`] in a definition.
pub const IMPLEMENTATION_KEY: &str = "units.convert";

/// The units worker, with the definition it carries.
///
/// # Errors
///
/// [`WorkerError::Config`] when the definition is invalid.
pub fn worker() -> Result<Worker, WorkerError> {
    Worker::builder(NAME)
        .definition_json(DEFINITION)
        .tool(IMPLEMENTATION_KEY, Convert)
        .build()
}

/// The units worker as `--tool-definitions` configures it: the
/// `units.convert` definitions in `dir` (an operator's edited description,
/// another version) are served instead of the one the binary carries; a
/// directory without any (the fleet's shared one) leaves the carried one.
/// A `dir` that does not exist is an error, unless it is the default
/// (`tool_definitions`, relative: the binary is usually run elsewhere).
///
/// # Errors
///
/// [`WorkerError::Config`] for a missing directory that was named, an
/// unreadable or invalid definition file in it, or an invalid definition.
pub fn worker_from(dir: &Path) -> Result<Worker, WorkerError> {
    if !dir.is_dir() {
        if dir == Path::new(toolfleet_worker::service::args::DEFAULT_TOOL_DEFINITIONS) {
            return worker();
        }
        return Err(WorkerError::Config(format!(
            "--tool-definitions {}: no such directory",
            dir.display()
        )));
    }
    let ours: Vec<_> = toolfleet_worker::protocol::tools::load_dir(dir)
        .map_err(|e| WorkerError::Config(e.to_string()))?
        .into_iter()
        .filter(|d| d.implementation_key == IMPLEMENTATION_KEY)
        .collect();
    if ours.is_empty() {
        return worker();
    }
    ours.into_iter()
        .fold(Worker::builder(NAME), |b, d| b.definition(d))
        .tool(IMPLEMENTATION_KEY, Convert)
        .build()
}

/// `units.convert`.
pub struct Convert;

/// Arguments of [`Convert`] (the schema has already checked them).
#[derive(Debug, Deserialize)]
pub struct ConvertArgs {
    pub value: f64,
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Length,
    Mass,
    Volume,
    Temperature,
}

/// A unit's kind and its size in the kind's base unit (metre, kilogram,
/// litre); temperatures convert through kelvin instead.
fn unit(name: &str) -> Option<(Kind, f64)> {
    use Kind::*;
    Some(match name {
        "mm" => (Length, 0.001),
        "cm" => (Length, 0.01),
        "m" => (Length, 1.0),
        "km" => (Length, 1000.0),
        "in" => (Length, 0.0254),
        "ft" => (Length, 0.3048),
        "yd" => (Length, 0.9144),
        "mi" => (Length, 1609.344),
        "g" => (Mass, 0.001),
        "kg" => (Mass, 1.0),
        "oz" => (Mass, 0.028_349_523_125),
        "lb" => (Mass, 0.453_592_37),
        "ml" => (Volume, 0.001),
        "l" => (Volume, 1.0),
        "floz" => (Volume, 0.029_573_529_562_5),
        "gal" => (Volume, 3.785_411_784),
        "C" | "F" | "K" => (Temperature, 1.0),
        _ => return None,
    })
}

fn to_kelvin(value: f64, unit: &str) -> f64 {
    match unit {
        "C" => value + 273.15,
        "F" => (value - 32.0) * 5.0 / 9.0 + 273.15,
        _ => value,
    }
}

fn from_kelvin(kelvin: f64, unit: &str) -> f64 {
    match unit {
        "C" => kelvin - 273.15,
        "F" => (kelvin - 273.15) * 9.0 / 5.0 + 32.0,
        _ => kelvin,
    }
}

/// Converts `value` from one unit to another of the same kind.
///
/// # Errors
///
/// [`ToolError::InvalidInput`] for an unknown unit or units of different
/// kinds (the model should fix the call).
pub fn convert(value: f64, from: &str, to: &str) -> Result<f64, ToolError> {
    let (from_kind, from_size) =
        unit(from).ok_or_else(|| ToolError::invalid(format!("unknown unit {from:?}")))?;
    let (to_kind, to_size) =
        unit(to).ok_or_else(|| ToolError::invalid(format!("unknown unit {to:?}")))?;
    if from_kind != to_kind {
        return Err(ToolError::invalid(format!(
            "cannot convert {from} ({from_kind:?}) to {to} ({to_kind:?}): pick units of one kind"
        )));
    }
    Ok(if from_kind == Kind::Temperature {
        from_kelvin(to_kelvin(value, from), to)
    } else {
        value * from_size / to_size
    })
}

/// Rounds to 6 significant digits for display.
fn shown(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = 6 - (x.abs().log10().floor() as i32 + 1);
    let factor = 10f64.powi(digits);
    format!("{}", (x * factor).round() / factor)
}

impl Tool for Convert {
    type Args = ConvertArgs;

    async fn call(&self, ctx: &ToolCtx, args: ConvertArgs) -> Result<ToolOutput, ToolError> {
        let result = convert(args.value, &args.from, &args.to)?;
        let cited = ctx
            .cite(vec![NewReference {
                kind: "web".into(),
                title: "NIST Guide to the SI, Appendix B: conversion factors".into(),
                source: Some("NIST Special Publication 811".into()),
                url: Some("https://www.nist.gov/pml/special-publication-811".into()),
                snippet: Some(format!("1 {} in {}", args.from, args.to)),
            }])
            .await?;
        let marker = cited.first().map(|r| r.marker()).unwrap_or_default();
        ToolOutput::text(format!(
            "{} {} = {} {} {marker}",
            shown(args.value),
            args.from,
            shown(result),
            args.to
        ))
        .with_data(json!({ "value": result, "unit": args.to }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_worker::TestCtx;

    fn served(worker: &Worker) -> Vec<(String, String)> {
        worker
            .definitions()
            .map(|d| (d.id.to_string(), d.description.clone()))
            .collect()
    }

    /// A fresh directory under the system's temporary one.
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("units-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `--tool-definitions` is honoured: the directory's `units.convert`
    /// definitions replace the carried one; a directory without any (the
    /// fleet's shared one) leaves it; a named directory that does not exist
    /// is a configuration error. (Before: the flag was ignored.)
    #[test]
    fn tool_definitions_replace_the_carried_definition() {
        let dir = scratch("defs");
        let mut def: serde_json::Value = serde_json::from_str(DEFINITION).unwrap();
        def["id"] = json!("units:convert@1.1.0");
        def["description"] = json!("Our edited description.");
        std::fs::write(dir.join("units.convert.json"), def.to_string()).unwrap();
        let w = worker_from(&dir).unwrap();
        assert_eq!(
            served(&w),
            [(
                "units:convert@1.1.0".to_owned(),
                "Our edited description.".to_owned()
            )]
        );

        let shared = scratch("shared");
        let fleets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions");
        let clock = "system.current_datetime.json";
        std::fs::copy(fleets.join(clock), shared.join(clock)).unwrap();
        let w = worker_from(&shared).unwrap();
        assert_eq!(served(&w)[0].0, "units:convert@1.0.0");

        let missing = dir.join("nope");
        match worker_from(&missing) {
            Err(WorkerError::Config(e)) => assert!(e.contains("no such directory"), "{e}"),
            other => panic!("{:?}", other.map(|w| served(&w))),
        }
        std::fs::write(dir.join("broken.json"), "{").unwrap();
        assert!(worker_from(&dir).is_err(), "a broken file is an error");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&shared);
    }

    #[test]
    fn converts_within_a_kind_and_refuses_across_kinds() {
        assert!((convert(1.0, "mi", "km").unwrap() - 1.609_344).abs() < 1e-9);
        assert!((convert(100.0, "C", "F").unwrap() - 212.0).abs() < 1e-9);
        assert!((convert(0.0, "K", "C").unwrap() + 273.15).abs() < 1e-9);
        assert!(matches!(
            convert(1.0, "kg", "m"),
            Err(ToolError::InvalidInput(_))
        ));
    }

    #[tokio::test]
    async fn a_call_cites_its_source_and_the_schema_guards_it() {
        let def = toolfleet_worker::protocol::tools::ToolDefinition::from_value(
            serde_json::from_str(DEFINITION).unwrap(),
            toolfleet_worker::protocol::tools::Origin::Named("units".into()),
        )
        .unwrap();
        let ctx = TestCtx::new();
        let out = ctx
            .call_checked(
                &def,
                &Convert,
                json!({"value": 5, "from": "km", "to": "mi"}),
            )
            .await
            .unwrap();
        assert_eq!(out.content, "5 km = 3.10686 mi [doc:1]");
        assert_eq!(out.data.unwrap()["unit"], "mi");
        let refs = ctx.references();
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].index, 1);
        assert_eq!(refs[0].tool_id.as_deref(), Some("units:convert@1.0.0"));

        let bad = ctx
            .call_checked(
                &def,
                &Convert,
                json!({"value": 5, "from": "km", "to": "parsec"}),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(bad, ToolError::InvalidInput(ref m) if m.contains("/to")),
            "{bad:?}"
        );
        // Nothing was cited for the refused call.
        assert_eq!(ctx.references().len(), 1);
    }

    #[test]
    fn the_worker_serves_the_shipped_definition() {
        let w = worker().unwrap();
        let ids: Vec<String> = w.definitions().map(|d| d.id.to_string()).collect();
        assert_eq!(ids, ["units:convert@1.0.0"]);
    }
}
