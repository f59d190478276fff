//! Operator settings of a worker's tools, shaped by each definition's
//! `settingsSchema`: read once at start-up, validated, and handed to the
//! tools when they are built.
//!
//! The settings file (`--settings`, `TOOLFLEET_TOOL_SETTINGS`) is TOML with
//! one table per tool, named `ns:name`:
//!
//! ```toml
//! ["web:search"]
//! backend = "brave"
//! maxResults = 8
//! braveApiKey = { env = "BRAVE_API_KEY" }      # or { file = "/run/secrets/brave" }
//! ```
//!
//! A property marked `"secret": true` in the schema never comes from the
//! file itself: only from an environment variable or a file the table
//! names, or, when the table names none, from
//! `TOOLFLEET_<NS>_<NAME>_<SETTING>` (the setting in upper snake case,
//! `braveApiKey` → `BRAVE_API_KEY`) or the file named by the same variable
//! with `_FILE` appended. A literal secret in the file is an error, so a
//! key never ends up in a config repository. Secret values are
//! [`Secret`]s: their `Debug` and `Display` never show them, and a worker
//! scrubs them from everything it publishes ([`crate::WorkerBuilder::secrets`]).
//!
//! Schema defaults fill absent properties; the assembled object is checked
//! against the schema, and an unknown table or property is an error — a
//! typo must not silently fall back to a default. Errors name the tool and
//! the setting, never a secret's value.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use toolfleet_protocol::schema::Validator;
use toolfleet_protocol::tools::ToolDefinition;

/// A setting that failed to load or check. The message names the tool and
/// the setting; it never holds a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SettingsError(pub String);

/// A secret value: shown as `<redacted>`; read it with [`Secret::expose`]
/// only where it is used (a request header).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    #[must_use]
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Where secrets come from: the process environment and files
/// ([`ProcessSecrets`]), or a map in tests.
pub trait SecretSource {
    /// The environment variable `name`, if set.
    fn var(&self, name: &str) -> Option<String>;
    /// The contents of the file at `path`.
    ///
    /// # Errors
    ///
    /// The file cannot be read.
    fn read(&self, path: &Path) -> std::io::Result<String>;
}

/// The process's environment and file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessSecrets;

impl SecretSource for ProcessSecrets {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    fn read(&self, path: &Path) -> std::io::Result<String> {
        std::fs::read_to_string(path)
    }
}

/// Fixed variables and files, for tests.
impl SecretSource for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }

    fn read(&self, path: &Path) -> std::io::Result<String> {
        self.get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }
}

/// The settings file: one TOML table per tool.
#[derive(Debug, Clone, Default)]
pub struct SettingsFile {
    tables: BTreeMap<String, toml::Table>,
    origin: Option<PathBuf>,
}

impl SettingsFile {
    /// No settings: every tool gets its schema's defaults.
    #[must_use]
    pub fn empty() -> Self {
        Self::default()
    }

    /// Reads and parses `path`.
    ///
    /// # Errors
    ///
    /// The file cannot be read, is not TOML, or has a top-level value that
    /// is not a table.
    pub fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SettingsError(format!(
                "cannot read the settings file {}: {e}",
                path.display()
            ))
        })?;
        let mut file = Self::parse(&text).map_err(|SettingsError(m)| {
            SettingsError(format!("settings file {}: {m}", path.display()))
        })?;
        file.origin = Some(path.to_owned());
        Ok(file)
    }

    /// Parses settings held as TOML text.
    ///
    /// # Errors
    ///
    /// Not TOML, or a top-level value that is not a table.
    pub fn parse(text: &str) -> Result<Self, SettingsError> {
        let table: toml::Table = toml::from_str(text)
            // TOML's message quotes the line, which may hold a secret
            // written where it should not be: say where, not what.
            .map_err(|e| SettingsError(format!("not valid TOML{}", toml_location(&e))))?;
        let mut tables = BTreeMap::new();
        for (tool, value) in table {
            match value {
                toml::Value::Table(t) => {
                    tables.insert(tool, t);
                }
                _ => {
                    return Err(SettingsError(format!(
                        "{tool:?} must be a table of settings (write [\"{tool}\"] above them)"
                    )));
                }
            }
        }
        Ok(Self {
            tables,
            origin: None,
        })
    }

    /// Checks that every table names one of `served` (`ns:name`): a table
    /// for a tool this worker does not serve is a typo or a wrong file.
    ///
    /// # Errors
    ///
    /// The unknown tables, with the tools that are served.
    pub fn check_tools<'a>(
        &self,
        served: impl IntoIterator<Item = &'a ToolDefinition>,
    ) -> Result<(), SettingsError> {
        let served: Vec<String> = served.into_iter().map(short_name).collect();
        let unknown: Vec<&String> = self.tables.keys().filter(|k| !served.contains(k)).collect();
        if unknown.is_empty() {
            return Ok(());
        }
        Err(SettingsError(format!(
            "settings for {} which this worker does not serve (it serves {})",
            unknown
                .iter()
                .map(|k| format!("{k:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            served.join(", ")
        )))
    }

    /// The settings of `definition`'s tool: its table (if any) with secrets
    /// read from `secrets` and the schema's defaults filled in, checked
    /// against `settingsSchema`.
    ///
    /// # Errors
    ///
    /// An unknown setting, a secret written in the file or not found, a
    /// value the schema refuses.
    pub fn tool(
        &self,
        definition: &ToolDefinition,
        secrets: &dyn SecretSource,
    ) -> Result<ToolSettings, SettingsError> {
        let tool = short_name(definition);
        let err = |m: String| SettingsError(format!("settings of {tool}: {m}"));
        let empty = toml::Table::new();
        let table = self.tables.get(&tool).unwrap_or(&empty);
        let schema = definition.settings_schema.as_ref();
        let properties = schema
            .and_then(|s| s.get("properties"))
            .and_then(Value::as_object);
        let secret_names: Vec<String> = definition.settings_secret_fields();
        let mut values = Map::new();
        let mut secret_values = BTreeMap::new();
        for (name, value) in table {
            let Some(_) = properties.and_then(|p| p.get(name)) else {
                let known: Vec<&str> = properties
                    .map(|p| p.keys().map(String::as_str).collect())
                    .unwrap_or_default();
                return Err(err(format!(
                    "unknown setting {name:?} (settings: {})",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                )));
            };
            if secret_names.contains(name) {
                let secret = secret_from_reference(name, value, secrets).map_err(&err)?;
                values.insert(name.clone(), Value::String(secret.expose().to_owned()));
                secret_values.insert(name.clone(), secret);
            } else {
                let json = serde_json::to_value(value)
                    .map_err(|e| err(format!("setting {name:?}: {e}")))?;
                values.insert(name.clone(), json);
            }
        }
        for name in &secret_names {
            if values.contains_key(name) {
                continue;
            }
            let variable = secret_variable(definition, name);
            if let Some(secret) = secret_from_environment(&variable, secrets).map_err(&err)? {
                values.insert(name.clone(), Value::String(secret.expose().to_owned()));
                secret_values.insert(name.clone(), secret);
            }
        }
        if let Some(properties) = properties {
            for (name, property) in properties {
                if let (false, Some(default)) = (values.contains_key(name), property.get("default"))
                {
                    values.insert(name.clone(), default.clone());
                }
            }
        }
        let object = Value::Object(values);
        if let Some(schema) = schema {
            let validator = Validator::compile(schema).map_err(|e| {
                err(format!(
                    "the definition's settingsSchema does not compile: {e}"
                ))
            })?;
            if let Err(violations) = validator.validate(&object) {
                let lines: Vec<String> = violations
                    .iter()
                    .map(|v| {
                        let setting = v.path.trim_start_matches('/').split('/').next();
                        match setting {
                            // The validator's message may quote the value.
                            Some(s) if secret_values.contains_key(s) => {
                                format!(
                                    "secret setting {s:?} is not valid (its value is not shown)"
                                )
                            }
                            _ => v.to_string(),
                        }
                    })
                    .collect();
                // A message about the whole object may quote it, secrets
                // and all: scrub them whatever the path.
                let scrubber = Scrubber::new(secret_values.values().cloned());
                return Err(err(scrubber.text(&lines.join("; "))));
            }
        }
        let Value::Object(values) = object else {
            unreachable!("built as an object")
        };
        Ok(ToolSettings {
            tool,
            values,
            secrets: secret_values,
        })
    }

    /// Where the settings came from, for messages.
    #[must_use]
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }
}

/// `ns:name` of a definition: the key of its table.
fn short_name(definition: &ToolDefinition) -> String {
    format!("{}:{}", definition.id.namespace, definition.id.name)
}

/// `TOOLFLEET_<NS>_<NAME>_<SETTING>`: the variable a secret comes from
/// when the settings file names none.
#[must_use]
pub fn secret_variable(definition: &ToolDefinition, setting: &str) -> String {
    let mut snake = String::new();
    for (i, c) in setting.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            snake.push('_');
        }
        if c.is_ascii_alphanumeric() {
            snake.push(c.to_ascii_uppercase());
        } else {
            snake.push('_');
        }
    }
    let upper = |s: &str| s.to_ascii_uppercase().replace(['-', '.'], "_");
    format!(
        "TOOLFLEET_{}_{}_{snake}",
        upper(&definition.id.namespace),
        upper(&definition.id.name)
    )
}

fn toml_location(e: &toml::de::Error) -> String {
    e.span()
        .map_or_else(String::new, |span| format!(" (at byte {})", span.start))
}

/// A secret's value without the trailing newline a secret file usually
/// ends with; an empty one is missing.
fn secret_value(raw: String, what: &str) -> Result<Secret, String> {
    let value = raw.trim_end_matches(['\n', '\r']);
    if value.is_empty() {
        return Err(format!("{what} is empty"));
    }
    Ok(Secret::new(value))
}

fn secret_from_reference(
    name: &str,
    value: &toml::Value,
    secrets: &dyn SecretSource,
) -> Result<Secret, String> {
    let refuse = || {
        format!(
            "{name:?} is secret: name where it comes from, {name} = {{ env = \"VARIABLE\" }} or \
             {name} = {{ file = \"/run/secrets/...\" }}, never the value itself"
        )
    };
    let toml::Value::Table(reference) = value else {
        return Err(refuse());
    };
    match (
        reference.get("env").and_then(toml::Value::as_str),
        reference.get("file").and_then(toml::Value::as_str),
    ) {
        (Some(variable), None) if reference.len() == 1 => {
            let raw = secrets.var(variable).ok_or_else(|| {
                format!("secret {name:?} comes from the environment variable {variable}, which is not set")
            })?;
            secret_value(
                raw,
                &format!("the environment variable {variable} (secret {name:?})"),
            )
        }
        (None, Some(path)) if reference.len() == 1 => {
            let raw = secrets.read(Path::new(path)).map_err(|e| {
                format!("secret {name:?} comes from the file {path}, which cannot be read: {e}")
            })?;
            secret_value(raw, &format!("the file {path} (secret {name:?})"))
        }
        _ => Err(refuse()),
    }
}

/// The secret a per-tenant setting names (`{"env": "NAME"}` or
/// `{"file": "/path"}`, as `toolfleet settings set` writes it), read from
/// `secrets` on this worker's host. A literal value is refused: a secret
/// never travels on NATS, only where it is. Errors name the setting and
/// the reference, never a value.
///
/// # Errors
///
/// Not a reference, or the variable or file is missing or empty.
pub fn secret_from_json_reference(
    name: &str,
    value: &Value,
    secrets: &dyn SecretSource,
) -> Result<Secret, SettingsError> {
    let reference = match value {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| {
                v.as_str()
                    .map(|s| (k.clone(), toml::Value::String(s.to_owned())))
            })
            .collect::<Option<toml::Table>>()
            .map(toml::Value::Table),
        _ => None,
    };
    let reference = reference.unwrap_or(toml::Value::Boolean(false));
    secret_from_reference(name, &reference, secrets).map_err(SettingsError)
}

fn secret_from_environment(
    variable: &str,
    secrets: &dyn SecretSource,
) -> Result<Option<Secret>, String> {
    if let Some(raw) = secrets.var(variable) {
        return secret_value(raw, &format!("the environment variable {variable}")).map(Some);
    }
    let file_variable = format!("{variable}_FILE");
    if let Some(path) = secrets.var(&file_variable) {
        let raw = secrets
            .read(Path::new(&path))
            .map_err(|e| format!("{file_variable} names {path}, which cannot be read: {e}"))?;
        return secret_value(raw, &format!("the file {path} ({file_variable})")).map(Some);
    }
    Ok(None)
}

/// One tool's checked settings.
#[derive(Clone)]
pub struct ToolSettings {
    tool: String,
    values: Map<String, Value>,
    secrets: BTreeMap<String, Secret>,
}

impl fmt::Debug for ToolSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: BTreeMap<&String, String> = self
            .values
            .iter()
            .map(|(k, v)| {
                let v = if self.secrets.contains_key(k) {
                    "<redacted>".to_owned()
                } else {
                    v.to_string()
                };
                (k, v)
            })
            .collect();
        f.debug_struct("ToolSettings")
            .field("tool", &self.tool)
            .field("values", &shown)
            .finish()
    }
}

impl ToolSettings {
    /// Settings of a definition with no file: its schema's defaults,
    /// checked (what tests and a worker without `--settings` use).
    ///
    /// # Errors
    ///
    /// As [`SettingsFile::tool`].
    pub fn defaults(definition: &ToolDefinition) -> Result<Self, SettingsError> {
        SettingsFile::empty().tool(definition, &BTreeMap::new())
    }

    /// The tool, `ns:name`.
    #[must_use]
    pub fn tool(&self) -> &str {
        &self.tool
    }

    /// A plain setting, deserialised; `Ok(None)` when absent with no
    /// default. A secret is not read this way: see [`ToolSettings::secret`].
    ///
    /// # Errors
    ///
    /// The value does not fit `T` (the schema and the code disagree).
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, SettingsError> {
        if self.secrets.contains_key(name) {
            return Err(SettingsError(format!(
                "settings of {}: {name:?} is secret; read it with secret()",
                self.tool
            )));
        }
        match self.values.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| SettingsError(format!("settings of {}: {name:?}: {e}", self.tool))),
        }
    }

    /// A secret setting, when it was given.
    #[must_use]
    pub fn secret(&self, name: &str) -> Option<&Secret> {
        self.secrets.get(name)
    }

    /// Every secret's value: what the worker scrubs from its output.
    pub fn secrets(&self) -> impl Iterator<Item = &Secret> {
        self.secrets.values()
    }
}

/// Replaces known secret values wherever they appear in what a worker
/// publishes — result text, data, error messages, references, warnings —
/// so a backend that echoes a key back (in an error page, say) cannot leak
/// it through a tool. Values shorter than 4 characters are not secrets
/// worth the name and are not scrubbed (they would mangle ordinary text).
#[derive(Debug, Clone, Default)]
pub struct Scrubber {
    secrets: Vec<Secret>,
}

/// What a scrubbed secret becomes.
pub const REDACTED: &str = "[redacted]";

impl Scrubber {
    /// Scrubs `secrets`.
    pub fn new(secrets: impl IntoIterator<Item = Secret>) -> Self {
        let mut secrets: Vec<Secret> = secrets
            .into_iter()
            .filter(|s| s.expose().len() >= 4)
            .collect();
        // Longest first, so a secret containing another goes whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.expose().len()));
        secrets.dedup();
        Self { secrets }
    }

    /// Whether there is nothing to scrub.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// `text` with every secret replaced by [`REDACTED`].
    #[must_use]
    pub fn text(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for secret in &self.secrets {
            if out.contains(secret.expose()) {
                out = out.replace(secret.expose(), REDACTED);
            }
        }
        out
    }

    /// Scrubs `text` in place.
    pub fn in_place(&self, text: &mut String) {
        if self.secrets.iter().any(|s| text.contains(s.expose())) {
            *text = self.text(text);
        }
    }

    /// Scrubs every string (keys too) of `value` in place.
    pub fn value(&self, value: &mut Value) {
        match value {
            Value::String(s) => self.in_place(s),
            Value::Array(items) => items.iter_mut().for_each(|v| self.value(v)),
            Value::Object(map) => {
                let scrubbed: Map<String, Value> = std::mem::take(map)
                    .into_iter()
                    .map(|(k, mut v)| {
                        self.value(&mut v);
                        (self.text(&k), v)
                    })
                    .collect();
                *map = scrubbed;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_scrubber_replaces_secrets_everywhere_in_values() {
        let s = Scrubber::new([
            Secret::new("canary-42"),
            Secret::new("ab"),
            Secret::new("canary-42-long"),
        ]);
        assert_eq!(
            s.text("key canary-42-long and canary-42, ab"),
            "key [redacted] and [redacted], ab"
        );
        let mut v = json!({"canary-42": ["x canary-42 y", 3, {"k": "canary-42"}]});
        s.value(&mut v);
        assert_eq!(
            v,
            json!({"[redacted]": ["x [redacted] y", 3, {"k": "[redacted]"}]})
        );
        assert!(Scrubber::new([]).is_empty());
    }

    fn definition() -> ToolDefinition {
        ToolDefinition::from_value(
            json!({
                "schemaVersion": 1,
                "id": "web:search@1.0.0",
                "implementationKey": "web.search",
                "title": "t",
                "description": "d",
                "category": "web",
                "function": {
                    "name": "web_search",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {}}
                },
                "settingsSchema": {
                    "type": "object",
                    "additionalProperties": false,
                    "properties": {
                        "backend": {"enum": ["duckduckgo", "brave"], "default": "duckduckgo"},
                        "maxResults": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
                        "braveApiKey": {"type": "string", "minLength": 8, "secret": true}
                    }
                }
            }),
            toolfleet_protocol::tools::Origin::Named("test".into()),
        )
        .unwrap()
    }

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_fill_absent_settings() {
        let s = ToolSettings::defaults(&definition()).unwrap();
        assert_eq!(
            s.get::<String>("backend").unwrap().as_deref(),
            Some("duckduckgo")
        );
        assert_eq!(s.get::<u32>("maxResults").unwrap(), Some(5));
        assert!(s.secret("braveApiKey").is_none());
        assert_eq!(s.tool(), "web:search");
    }

    #[test]
    fn plain_settings_come_from_the_file_and_are_checked() {
        let file =
            SettingsFile::parse("[\"web:search\"]\nbackend = \"brave\"\nmaxResults = 9\n").unwrap();
        let s = file.tool(&definition(), &env(&[])).unwrap();
        assert_eq!(
            s.get::<String>("backend").unwrap().as_deref(),
            Some("brave")
        );
        assert_eq!(s.get::<u32>("maxResults").unwrap(), Some(9));

        for (text, expected) in [
            (
                "[\"web:search\"]\nmaxResults = 50\n",
                "50 is greater than the maximum of 20",
            ),
            ("[\"web:search\"]\nbackend = \"bing\"\n", "/backend"),
            (
                "[\"web:search\"]\nmaxResult = 3\n",
                "unknown setting \"maxResult\"",
            ),
        ] {
            let e = SettingsFile::parse(text)
                .unwrap()
                .tool(&definition(), &env(&[]))
                .unwrap_err();
            assert!(e.0.contains(expected), "{e}");
            assert!(e.0.starts_with("settings of web:search:"), "{e}");
        }
        let e = SettingsFile::parse("[\"web:serch\"]\nbackend = \"brave\"\n")
            .unwrap()
            .check_tools([&definition()])
            .unwrap_err();
        assert!(
            e.0.contains("\"web:serch\"") && e.0.contains("serves web:search"),
            "{e}"
        );
        assert!(SettingsFile::parse("backend = 3").is_err());
        assert!(SettingsFile::parse("[x\n").is_err());
    }

    #[test]
    fn secrets_come_only_from_the_environment_or_files() {
        let def = definition();
        // The default variable.
        let s = SettingsFile::empty()
            .tool(
                &def,
                &env(&[("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "canary-0001\n")]),
            )
            .unwrap();
        assert_eq!(s.secret("braveApiKey").unwrap().expose(), "canary-0001");
        assert!(!format!("{s:?}").contains("canary"), "{s:?}");
        assert!(
            s.get::<String>("braveApiKey").is_err(),
            "secrets are not plain settings"
        );
        // The default variable's _FILE form.
        let s = SettingsFile::empty()
            .tool(
                &def,
                &env(&[
                    (
                        "TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY_FILE",
                        "/run/secrets/brave",
                    ),
                    ("/run/secrets/brave", "canary-0002\n"),
                ]),
            )
            .unwrap();
        assert_eq!(s.secret("braveApiKey").unwrap().expose(), "canary-0002");
        // Named in the file.
        let file = SettingsFile::parse("[\"web:search\"]\nbraveApiKey = { env = \"BRAVE_KEY\" }\n")
            .unwrap();
        let s = file
            .tool(&def, &env(&[("BRAVE_KEY", "canary-0003")]))
            .unwrap();
        assert_eq!(s.secret("braveApiKey").unwrap().expose(), "canary-0003");
        let file =
            SettingsFile::parse("[\"web:search\"]\nbraveApiKey = { file = \"/k\" }\n").unwrap();
        let s = file.tool(&def, &env(&[("/k", "canary-0004")])).unwrap();
        assert_eq!(s.secret("braveApiKey").unwrap().expose(), "canary-0004");

        // Written in the file: refused, without echoing it.
        let e = SettingsFile::parse("[\"web:search\"]\nbraveApiKey = \"canary-0005\"\n")
            .unwrap()
            .tool(&def, &env(&[]))
            .unwrap_err();
        assert!(e.0.contains("is secret") && !e.0.contains("canary"), "{e}");
        // Named but missing, or empty.
        let e = file.tool(&def, &env(&[])).unwrap_err();
        assert!(e.0.contains("/k"), "{e}");
        let e = SettingsFile::parse("[\"web:search\"]\nbraveApiKey = { env = \"NOPE\" }\n")
            .unwrap()
            .tool(&def, &env(&[]))
            .unwrap_err();
        assert!(e.0.contains("NOPE, which is not set"), "{e}");
        let e = SettingsFile::empty()
            .tool(&def, &env(&[("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "\n")]))
            .unwrap_err();
        assert!(e.0.contains("is empty"), "{e}");
        // A value the schema refuses: named, not shown.
        let e = SettingsFile::empty()
            .tool(
                &def,
                &env(&[("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "canary")]),
            )
            .unwrap_err();
        assert!(
            e.0.contains("\"braveApiKey\" is not valid") && !e.0.contains("canary"),
            "{e}"
        );
    }

    #[test]
    fn a_refusal_of_the_whole_object_does_not_quote_its_secret() {
        let mut value = serde_json::to_value(definition()).unwrap();
        value["settingsSchema"]["not"] = json!({"required": ["braveApiKey"]});
        let def = ToolDefinition::from_value(
            value,
            toolfleet_protocol::tools::Origin::Named("test".into()),
        )
        .unwrap();
        let e = SettingsFile::empty()
            .tool(
                &def,
                &env(&[("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "canary-root-42")]),
            )
            .unwrap_err();
        assert!(!e.0.contains("canary-root-42"), "{e}");
        assert!(e.0.contains("[redacted]") || e.0.contains("not"), "{e}");
    }

    #[tokio::test]
    async fn hooks_and_warnings_see_secrets_scrubbed() {
        use std::sync::{Arc, Mutex};
        #[derive(Default)]
        struct Seen(Mutex<Vec<String>>);
        struct Recorder(Arc<Seen>);
        impl crate::Hooks for Recorder {
            fn on_attempt_error(&self, _: &toolfleet_protocol::CallContext, _: &str, error: &str) {
                self.0.0.lock().unwrap().push(error.to_owned());
            }
            fn on_warning(
                &self,
                _: &toolfleet_protocol::CallContext,
                warning: &toolfleet_protocol::ToolWarning,
            ) {
                self.0.0.lock().unwrap().push(warning.message.clone());
            }
        }
        let seen = Arc::new(Seen::default());
        let secret = Secret::new("canary-hook-77");
        let ctx = crate::TestCtx::new()
            .with_secrets([&secret])
            .with_hooks(Recorder(seen.clone()))
            .ctx();
        ctx.attempt_failed("backend", "401: invalid token canary-hook-77");
        ctx.warning("w", &format!("{}canary-hook-77", "x".repeat(995)));
        let seen = seen.0.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        assert!(
            seen.iter()
                .all(|t| !t.contains("canary") && !t.contains("canary-h")),
            "{seen:?}"
        );
        assert!(seen[0].contains("[redacted]"), "{seen:?}");
    }

    #[test]
    fn variable_names_are_upper_snake_case() {
        assert_eq!(
            secret_variable(&definition(), "braveApiKey"),
            "TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY"
        );
    }
}
