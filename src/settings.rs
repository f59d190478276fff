//! `toolfleet settings set|get|ls|rm`: the operator's per-tenant tool
//! settings, kept in the settings bucket (`<P>_SETTINGS`, key
//! `<tenant>.<ns>.<name>`), which the orchestrators read and send in the
//! tool jobs of that tenant (`settings` of the job; a worker reads them
//! with `ToolCtx::settings`, `setting` and `secret`).
//!
//! `set` checks the settings against the tool's `settingsSchema` (from
//! the definitions directory, or the running fleet's catalog with
//! `--live`) and refuses an unknown setting or a value the schema refuses,
//! naming the failing path. A setting marked `"secret": true` is only ever
//! a reference — `{"env": "NAME"}` or `{"file": "/path"}`, read by the
//! worker on its own host — never a value: `set` refuses a literal one, so
//! no secret travels on NATS or rests in the bucket.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::{Map, Value};
use toolfleet_protocol::tools::ToolDefinition;
use toolfleet_service::args::{EXIT_CONFIG, NatsArgs, ToolDefsArgs};

#[derive(Subcommand, Debug)]
pub enum SettingsCommand {
    /// Set a tenant's settings of a tool: `key=value` pairs (a value is
    /// read as JSON when it is JSON, else as a string) merged into what is
    /// kept, or `--file` for the whole object. Exit 0 when stored, 64 when
    /// refused (unknown tool or setting, a value the schema refuses, a
    /// secret that is not a reference).
    Set(SetArgs),
    /// Print a tenant's settings of a tool (JSON). Exit 1 when there are
    /// none.
    Get(KeyArgs),
    /// List the tools a tenant has settings for (one `ns:name` a line).
    Ls(LsArgs),
    /// Remove a tenant's settings of a tool.
    Rm(KeyArgs),
}

/// The tenant and tool of a settings entry.
#[derive(Args, Debug)]
pub struct KeyArgs {
    /// The tenant the settings are for.
    #[arg(long)]
    tenant: String,
    /// The tool: `ns:name` (settings hold for every version) or
    /// `ns:name@x.y.z`.
    #[arg(long)]
    tool: String,
    #[command(flatten)]
    nats: NatsArgs,
}

#[derive(Args, Debug)]
pub struct SetArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// `setting=value` pairs; a secret's value is a reference,
    /// `apiKey='{"env":"ACME_API_KEY"}'`.
    values: Vec<String>,
    /// A JSON file holding the whole settings object (replacing what is
    /// kept; pairs are applied on top).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Check against the definitions the running fleet's workers serve
    /// instead of the definitions directory.
    #[arg(long)]
    live: bool,
    #[command(flatten)]
    defs: ToolDefsArgs,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// The tenant whose settings to list.
    #[arg(long)]
    tenant: String,
    /// Only this tool's (`ns:name`).
    #[arg(long)]
    tool: Option<String>,
    #[command(flatten)]
    nats: NatsArgs,
}

/// `toolfleet settings …`; the exit code.
pub async fn run(command: SettingsCommand) -> anyhow::Result<i32> {
    match command {
        SettingsCommand::Set(args) => set(args).await,
        SettingsCommand::Get(args) => get(args).await,
        SettingsCommand::Ls(args) => ls(args).await,
        SettingsCommand::Rm(args) => rm(args).await,
    }
}

/// `ns` and `name` of `--tool`, or a message.
fn tool_name(tool: &str) -> Result<(String, String), String> {
    let short = tool.split('@').next().unwrap_or_default();
    let reference: toolfleet_protocol::tools::ToolRef = short
        .parse()
        .map_err(|e| format!("--tool {tool:?} is not ns:name or ns:name@x.y.z: {e}"))?;
    match reference {
        toolfleet_protocol::tools::ToolRef::Name { namespace, name } => Ok((namespace, name)),
        _ => Err(format!("--tool {tool:?} names no one tool")),
    }
}

/// The bucket key of the flags' tenant and tool, or the exit code after
/// saying why not.
fn key_of(command: &str, tenant: &str, tool: &str) -> Result<String, i32> {
    if !crate::common::tenant_ok(command, tenant) {
        return Err(EXIT_CONFIG);
    }
    match tool_name(tool) {
        Ok((ns, name)) => Ok(toolfleet_protocol::settings_key(tenant, &ns, &name)),
        Err(e) => {
            eprintln!("{command}: {e}");
            Err(EXIT_CONFIG)
        }
    }
}

async fn bucket(nats: &NatsArgs) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-settings").await?;
    let js = async_nats::jetstream::new(client);
    toolfleet_protocol::streams::settings_bucket(&js, &subjects)
        .await
        .context("opening the settings bucket")
}

async fn set(args: SetArgs) -> anyhow::Result<i32> {
    const COMMAND: &str = "toolfleet settings set";
    let key = match key_of(COMMAND, &args.key.tenant, &args.key.tool) {
        Ok(key) => key,
        Err(code) => return Ok(code),
    };
    let Some(definition) = definition(&args).await? else {
        eprintln!(
            "{COMMAND}: no tool {} among the {}",
            args.key.tool,
            if args.live {
                "tools the running fleet serves"
            } else {
                "definitions"
            }
        );
        return Ok(EXIT_CONFIG);
    };
    let bucket = bucket(&args.key.nats).await?;
    let mut settings = match &args.file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(map)) => map,
                _ => {
                    eprintln!("{COMMAND}: {} holds no JSON object", path.display());
                    return Ok(EXIT_CONFIG);
                }
            }
        }
        None => match bucket.get(&key).await? {
            Some(bytes) => match serde_json::from_slice::<Value>(&bytes) {
                Ok(Value::Object(map)) => map,
                _ => Map::new(),
            },
            None => Map::new(),
        },
    };
    for pair in &args.values {
        let Some((name, value)) = pair.split_once('=') else {
            eprintln!("{COMMAND}: {pair:?} is not setting=value");
            return Ok(EXIT_CONFIG);
        };
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.into()));
        settings.insert(name.to_owned(), value);
    }
    if let Err(e) = check(&definition, &settings) {
        eprintln!("{COMMAND}: settings of {} refused: {e}", args.key.tool);
        return Ok(EXIT_CONFIG);
    }
    bucket
        .put(&key, serde_json::to_vec(&settings)?.into())
        .await
        .context("storing the settings")?;
    println!("{}", serde_json::to_string_pretty(&settings)?);
    Ok(0)
}

/// The definition `set` checks against: from the definitions directory,
/// or one reading of the running fleet's catalog.
async fn definition(args: &SetArgs) -> anyhow::Result<Option<ToolDefinition>> {
    use toolfleet_protocol::catalog::{Catalog, discover};
    use toolfleet_protocol::registry::{DirSource, Registry};
    let registry = if args.live {
        let subjects = args.key.nats.subjects()?;
        let client = args.key.nats.connect("toolfleet-settings").await?;
        let catalog = discover(
            &client,
            &subjects,
            Duration::from_millis(500),
            &Catalog::default(),
        )
        .await?;
        Registry::build(&[&catalog])
    } else {
        let dir = DirSource::load(&args.defs.dir).with_context(|| {
            format!("loading tool definitions from {}", args.defs.dir.display())
        })?;
        Registry::build(&[&dir])
    };
    Ok(registry.get(&args.key.tool).map(|e| e.definition().clone()))
}

/// Whether `settings` fit `definition`'s `settingsSchema`: known settings
/// only, every secret one a reference (`{"env": NAME}` or
/// `{"file": PATH}`), the others as the schema says. The error names the
/// failing setting or path, never a secret's value.
pub(crate) fn check(
    definition: &ToolDefinition,
    settings: &Map<String, Value>,
) -> Result<(), String> {
    let Some(schema) = &definition.settings_schema else {
        return Err("the tool takes no settings (its definition has no settingsSchema)".into());
    };
    let secrets = definition.settings_secret_fields();
    let mut plain_schema = schema.clone();
    let properties = plain_schema
        .get_mut("properties")
        .and_then(Value::as_object_mut);
    let known: Vec<String> = properties
        .as_ref()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    for (name, value) in settings {
        if !known.contains(name) {
            return Err(format!(
                "/{name}: unknown setting (settings: {})",
                known.join(", ")
            ));
        }
        if secrets.contains(name) && !is_reference(value) {
            return Err(format!(
                "/{name}: is secret: give where it is, {{\"env\": \"NAME\"}} or \
                 {{\"file\": \"/path\"}} (read by the worker), never the value"
            ));
        }
    }
    // The secrets are references here, not what the schema describes:
    // the plain settings are checked against the schema without them.
    if let Some(properties) = properties {
        properties.retain(|name, _| !secrets.contains(name));
    }
    if let Some(required) = plain_schema
        .get_mut("required")
        .and_then(Value::as_array_mut)
    {
        required.retain(|r| r.as_str().is_none_or(|r| !secrets.iter().any(|s| s == r)));
    }
    let plain: Map<String, Value> = settings
        .iter()
        .filter(|(name, _)| !secrets.contains(name))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let validator = toolfleet_protocol::schema::Validator::compile(&plain_schema)
        .map_err(|e| format!("the tool's settingsSchema does not compile: {e}"))?;
    validator
        .validate(&Value::Object(plain))
        .map_err(|violations| toolfleet_protocol::schema::describe(&violations))
}

/// `{"env": "NAME"}` or `{"file": "/path"}`, exactly.
fn is_reference(value: &Value) -> bool {
    let Some(map) = value.as_object() else {
        return false;
    };
    map.len() == 1
        && map.iter().all(|(k, v)| {
            (k == "env" || k == "file") && v.as_str().is_some_and(|s| !s.trim().is_empty())
        })
}

async fn get(args: KeyArgs) -> anyhow::Result<i32> {
    let key = match key_of("toolfleet settings get", &args.tenant, &args.tool) {
        Ok(key) => key,
        Err(code) => return Ok(code),
    };
    match bucket(&args.nats).await?.get(&key).await? {
        Some(bytes) => {
            let value: Value = serde_json::from_slice(&bytes)?;
            println!("{}", serde_json::to_string_pretty(&value)?);
            Ok(0)
        }
        None => {
            eprintln!(
                "toolfleet settings get: tenant {} has no settings of {}",
                args.tenant, args.tool
            );
            Ok(1)
        }
    }
}

async fn ls(args: LsArgs) -> anyhow::Result<i32> {
    if !crate::common::tenant_ok("toolfleet settings ls", &args.tenant) {
        return Ok(EXIT_CONFIG);
    }
    let wanted = match args.tool.as_deref().map(tool_name).transpose() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("toolfleet settings ls: {e}");
            return Ok(EXIT_CONFIG);
        }
    };
    let bucket = bucket(&args.nats).await?;
    let mut keys = futures::TryStreamExt::try_collect::<Vec<String>>(bucket.keys().await?).await?;
    keys.sort();
    let prefix = format!("{}.", args.tenant);
    let mut out = std::io::stdout().lock();
    for key in keys {
        let Some((ns, name)) = key.strip_prefix(&prefix).and_then(|r| r.split_once('.')) else {
            continue;
        };
        if wanted
            .as_ref()
            .is_some_and(|(n, m)| n.as_str() != ns || m.as_str() != name)
        {
            continue;
        }
        writeln!(out, "{ns}:{name}")?;
    }
    Ok(0)
}

async fn rm(args: KeyArgs) -> anyhow::Result<i32> {
    let key = match key_of("toolfleet settings rm", &args.tenant, &args.tool) {
        Ok(key) => key,
        Err(code) => return Ok(code),
    };
    bucket(&args.nats).await?.purge(&key).await?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn web_search() -> ToolDefinition {
        toolfleet_protocol::tools::load_file(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tool_definitions/web.search.json"),
        )
        .unwrap()
    }

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn settings_are_checked_against_the_schema_and_secrets_are_references_only() {
        let d = web_search();
        check(&d, &map(json!({ "backend": "brave", "maxResults": 8 }))).unwrap();
        check(
            &d,
            &map(json!({ "braveApiKey": { "env": "ACME_BRAVE_KEY" } })),
        )
        .unwrap();
        check(
            &d,
            &map(json!({ "braveApiKey": { "file": "/run/secrets/brave" } })),
        )
        .unwrap();
        let e = check(&d, &map(json!({ "maxResults": 50 }))).unwrap_err();
        assert!(e.contains("/maxResults"), "{e}");
        let e = check(&d, &map(json!({ "maxResult": 5 }))).unwrap_err();
        assert!(e.contains("/maxResult: unknown setting"), "{e}");
        let e = check(&d, &map(json!({ "braveApiKey": "sk-literal-canary-123" }))).unwrap_err();
        assert!(e.contains("/braveApiKey: is secret"), "{e}");
        assert!(!e.contains("sk-literal-canary-123"), "{e}");
        let e = check(
            &d,
            &map(json!({ "braveApiKey": { "env": "X", "value": "sk-literal" } })),
        )
        .unwrap_err();
        assert!(!e.contains("sk-literal"), "{e}");
    }

    #[test]
    fn a_tool_is_named_without_or_with_its_version() {
        assert_eq!(
            tool_name("web:search").unwrap(),
            ("web".into(), "search".into())
        );
        assert_eq!(
            tool_name("web:search@1.0.0").unwrap(),
            ("web".into(), "search".into())
        );
        assert!(tool_name("web:*").is_err());
        assert!(tool_name("nope").is_err());
    }
}
