//! Reading the fleet's configuration file (TOML), shared by the two crates
//! that read it: this one for the model tables ([`crate::model_config`])
//! and `toolfleet-config` for the rest. Errors name the file, the dotted key
//! path and, for errors of shape, the line and column; the naming rules
//! every table shares live here too.
//!
//! # Invariants
//!
//! - A TOML error never quotes the source line: it may hold a key pasted in
//!   the wrong place. Only `toml`'s message is kept, with a position.

use std::fmt;
use std::path::Path;

use serde::de::DeserializeOwned;

/// A config file that cannot be used: names the file, the key and, where
/// known, the line and column.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub kind: ConfigErrorKind,
    /// The file name (or whatever origin was given).
    pub origin: String,
    /// Dotted key path, e.g. `profiles.default.policy.max_rounds`.
    pub key: Option<String>,
    /// 1-based line and column.
    pub position: Option<(usize, usize)>,
    pub message: String,
}

impl ConfigError {
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }

    /// A value out of range or a dangling reference at `key`
    /// ([`ConfigErrorKind::Invalid`]), from a validation step's
    /// `(key path, message)`.
    pub fn invalid(origin: &str, (key, message): (String, String)) -> Self {
        Self {
            kind: ConfigErrorKind::Invalid,
            origin: origin.to_owned(),
            key: Some(key),
            position: None,
            message,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((line, column)) = self.position {
            write!(f, ":{line}:{column}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// What kind of [`ConfigError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file could not be read.
    Read,
    /// Not TOML, or not the expected shape: unknown key, wrong type.
    Parse,
    /// A value out of range or a reference to something that does not exist.
    Invalid,
}

/// The file's text and its name for messages.
///
/// # Errors
///
/// [`ConfigErrorKind::Read`] when the file cannot be read.
pub fn read(path: &Path) -> Result<(String, String), ConfigError> {
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((text, origin)),
        Err(e) => Err(ConfigError {
            kind: ConfigErrorKind::Read,
            origin,
            key: None,
            position: None,
            message: e.to_string(),
        }),
    }
}

/// `text` deserialized as `T`; `origin` (a file name) goes into errors.
///
/// # Errors
///
/// [`ConfigErrorKind::Parse`] when the text is not TOML of `T`'s shape,
/// naming the key path and position.
pub fn parse<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, ConfigError> {
    let parse_error = |key: Option<String>, error: &toml::de::Error| ConfigError {
        kind: ConfigErrorKind::Parse,
        origin: origin.to_owned(),
        key,
        position: error.span().map(|span| line_and_column(text, span.start)),
        // Only the message: `toml`'s own Display quotes the source line,
        // which may hold a key pasted in the wrong place.
        message: error.message().to_owned(),
    };
    let deserializer = toml::Deserializer::parse(text).map_err(|e| parse_error(None, &e))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let key = (path != ".").then_some(path);
        parse_error(key, e.inner())
    })
}

/// `a, b, c`, or `none`.
pub fn names<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let list: Vec<&str> = names.map(String::as_str).collect();
    if list.is_empty() {
        "none".to_owned()
    } else {
        list.join(", ")
    }
}

/// A name as it appears in a dotted key path: quoted unless bare.
pub fn key_segment(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        name.to_owned()
    } else {
        format!("{name:?}")
    }
}

/// Profile, deployment and sink names travel in headers and logs: keep
/// them plain.
///
/// # Errors
///
/// The message for a name that is empty or has other characters than
/// letters, digits, `_`, `-` and `.`.
pub fn check_name(name: &str) -> Result<(), String> {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Ok(())
    } else {
        Err(format!(
            "bad name {name:?}: use letters, digits, `_`, `-` and `.`"
        ))
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`: the names `api_key_env` and `secret_env` may
/// hold.
pub fn is_env_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// 1-based line and column of a byte offset, for messages.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}
