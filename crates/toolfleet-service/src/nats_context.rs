//! The NATS settings other NATS tools read, as fallbacks for ours: the
//! `NATS_URL` and `NATS_CREDS` variables, then the `nats` CLI's selected
//! context. [`NatsArgs::with_fallbacks`](crate::args::NatsArgs::with_fallbacks)
//! fills only what the flags and the `TOOLFLEET_NATS_*` variables left
//! unset: explicit settings always win.
//!
//! A context is stored as the `nats` CLI stores it (ADR-21,
//! `nats-io/jsm.go`'s `natscontext`): under `$XDG_CONFIG_HOME` (else
//! `~/.config`), `nats/context.txt` names the selected context and
//! `nats/context/<name>.json` holds its settings; `NATS_CONTEXT` names
//! another, as it does for the CLI. Read here: `url`, `user` and
//! `password`, `creds`, `nkey` (a seed file), `token`, `ca`, `cert`,
//! `key` and `inbox_prefix`; of the identities the CLI's order counts
//! (user, creds, nkey, token). A `creds` or `nkey` given as an `nsc://`,
//! `op://`, `env://` or `data:` URI is a configuration error naming the
//! file: pass `--nats-creds` instead. Secrets read from a context never
//! appear in an error.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::bad_config::BadConfig;

/// The standard variable of the NATS server URL(s).
pub const ENV_NATS_URL: &str = "NATS_URL";
/// The standard variable of a `.creds` file.
pub const ENV_NATS_CREDS: &str = "NATS_CREDS";
/// The variable naming the `nats` CLI's context to use instead of the
/// selected one.
pub const ENV_NATS_CONTEXT: &str = "NATS_CONTEXT";

/// Environment variables, as a process reads them: the process's own
/// ([`ProcessVars`]) or, in tests, a map (no process-wide `set_var`).
pub trait Vars {
    /// The variable's value, when set.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process's own environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessVars;

impl Vars for ProcessVars {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl Vars for std::collections::HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// A variable's value, unless unset or blank.
pub(crate) fn set(vars: &dyn Vars, name: &str) -> Option<String> {
    vars.var(name).filter(|v| !v.trim().is_empty())
}

/// One `nats` CLI context: the settings we read of it (empty strings, as
/// the CLI writes unset fields, read as unset).
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
pub struct NatsContext {
    /// Its name, from the file's.
    #[serde(skip)]
    pub name: String,
    /// The file it was read from.
    #[serde(skip)]
    pub path: PathBuf,
    #[serde(default)]
    url: String,
    #[serde(default)]
    user: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    token: String,
    #[serde(default)]
    creds: String,
    #[serde(default)]
    nkey: String,
    #[serde(default)]
    cert: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    ca: String,
    #[serde(default)]
    inbox_prefix: String,
}

/// Who a context says we are, in the CLI's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContextIdentity {
    UserPassword(String, String),
    Creds(PathBuf),
    NKeySeedFile(PathBuf),
    Token(String),
}

fn some(s: &str) -> Option<&str> {
    Some(s.trim()).filter(|s| !s.is_empty())
}

impl NatsContext {
    /// The server URL(s).
    pub fn url(&self) -> Option<&str> {
        some(&self.url)
    }

    /// Its identity, if it has one.
    ///
    /// # Errors
    ///
    /// A `creds` or `nkey` that is a URI other than `file://`.
    pub fn identity(&self, vars: &dyn Vars) -> Result<Option<ContextIdentity>, BadConfig> {
        if let Some(user) = some(&self.user) {
            return Ok(Some(ContextIdentity::UserPassword(
                user.to_owned(),
                self.password.clone(),
            )));
        }
        if let Some(creds) = some(&self.creds) {
            return Ok(Some(ContextIdentity::Creds(
                self.file(vars, "creds", creds)?,
            )));
        }
        if let Some(nkey) = some(&self.nkey) {
            return Ok(Some(ContextIdentity::NKeySeedFile(
                self.file(vars, "nkey", nkey)?,
            )));
        }
        Ok(some(&self.token).map(|t| ContextIdentity::Token(t.to_owned())))
    }

    /// The CA file, the client certificate and its key.
    pub fn tls(&self, vars: &dyn Vars) -> (Option<PathBuf>, Option<(PathBuf, PathBuf)>) {
        let path = |s: &str| some(s).map(|s| expand_home(vars, s));
        let cert = path(&self.cert).zip(path(&self.key));
        (path(&self.ca), cert)
    }

    /// The prefix of request inboxes.
    pub fn inbox_prefix(&self) -> Option<&str> {
        some(&self.inbox_prefix)
    }

    /// A `creds` or `nkey` value as a path: a bare path or a `file://`
    /// URI, `~` expanded.
    fn file(&self, vars: &dyn Vars, field: &str, value: &str) -> Result<PathBuf, BadConfig> {
        if let Some(path) = value.strip_prefix("file://") {
            return Ok(expand_home(vars, path));
        }
        let scheme = value
            .split_once("://")
            .map(|(s, _)| s)
            .or_else(|| value.starts_with("data:").then_some("data"));
        if let Some(scheme) = scheme {
            return Err(BadConfig(format!(
                "the nats context {:?} ({}) gives its {field} as a `{scheme}:` URI, which \
                 toolfleet does not read: pass --nats-creds or --nats-nkey with a file instead",
                self.name,
                self.path.display()
            )));
        }
        Ok(expand_home(vars, value))
    }
}

/// `~/…` under `$HOME`.
fn expand_home(vars: &dyn Vars, path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), set(vars, "HOME")) {
        (Some(rest), Some(home)) => Path::new(&home).join(rest),
        _ => PathBuf::from(path),
    }
}

/// Where the `nats` CLI keeps its settings: `$XDG_CONFIG_HOME/nats`, else
/// `$HOME/.config/nats`.
fn nats_dir(vars: &dyn Vars) -> Option<PathBuf> {
    let root = set(vars, "XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| set(vars, "HOME").map(|h| Path::new(&h).join(".config")))?;
    Some(root.join("nats"))
}

/// The context to use: the one `NATS_CONTEXT` names, else the selected
/// one (`context.txt`); `None` when neither names one.
///
/// # Errors
///
/// A context named but missing, unreadable or not its JSON, or a name
/// that is not a file name.
pub fn selected(vars: &dyn Vars) -> Result<Option<NatsContext>, BadConfig> {
    let Some(dir) = nats_dir(vars) else {
        return Ok(None);
    };
    let name = match set(vars, ENV_NATS_CONTEXT) {
        Some(name) => name.trim().to_owned(),
        None => match std::fs::read_to_string(dir.join("context.txt")) {
            Ok(text) if !text.trim().is_empty() => text.trim().to_owned(),
            _ => return Ok(None),
        },
    };
    if name.contains("..") || name.contains('/') || name.contains('\\') {
        return Err(BadConfig(format!("invalid nats context name {name:?}")));
    }
    let path = dir.join("context").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        BadConfig(format!(
            "the selected nats context {name:?} cannot be read ({}): {e}",
            path.display()
        ))
    })?;
    // serde's message names the line and column, never the value.
    let mut context: NatsContext = serde_json::from_str(&text).map_err(|e| {
        BadConfig(format!(
            "the nats context {name:?} ({}) is not a context's JSON: line {}, column {}",
            path.display(),
            e.line(),
            e.column()
        ))
    })?;
    context.name = name;
    context.path = path;
    Ok(Some(context))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn write(dir: &Path, rel: &str, text: &str) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn the_selected_context_is_read_from_xdg_config_home_else_home() {
        let xdg = tempfile::tempdir().unwrap();
        write(xdg.path(), "nats/context.txt", "prod\n");
        write(
            xdg.path(),
            "nats/context/prod.json",
            r#"{"description":"","url":"nats://prod:4222","user":"","password":"","creds":"~/p.creds","nkey":"","token":"","cert":"","key":"","ca":"/ca.pem","nsc":"","jetstream_domain":"","inbox_prefix":"_INBOX.me"}"#,
        );
        let env = vars(&[
            ("XDG_CONFIG_HOME", xdg.path().to_str().unwrap()),
            ("HOME", "/home/op"),
        ]);
        let c = selected(&env).unwrap().unwrap();
        assert_eq!(
            (c.name.as_str(), c.url()),
            ("prod", Some("nats://prod:4222"))
        );
        assert_eq!(
            c.identity(&env).unwrap(),
            Some(ContextIdentity::Creds("/home/op/p.creds".into()))
        );
        assert_eq!(c.tls(&env), (Some("/ca.pem".into()), None));
        assert_eq!(c.inbox_prefix(), Some("_INBOX.me"));

        // Without XDG_CONFIG_HOME: ~/.config; NATS_CONTEXT picks another.
        let home = tempfile::tempdir().unwrap();
        write(home.path(), ".config/nats/context.txt", "a");
        write(
            home.path(),
            ".config/nats/context/a.json",
            r#"{"url":"nats://a:1"}"#,
        );
        write(
            home.path(),
            ".config/nats/context/b.json",
            r#"{"url":"nats://b:1","user":"u","password":"pw","creds":"x.creds","token":"t"}"#,
        );
        let home_str = home.path().to_str().unwrap();
        let env = vars(&[("HOME", home_str)]);
        assert_eq!(selected(&env).unwrap().unwrap().url(), Some("nats://a:1"));
        let env = vars(&[("HOME", home_str), (ENV_NATS_CONTEXT, "b")]);
        let b = selected(&env).unwrap().unwrap();
        // The CLI's order: a user before creds and a token.
        assert_eq!(
            b.identity(&env).unwrap(),
            Some(ContextIdentity::UserPassword("u".into(), "pw".into()))
        );
    }

    #[test]
    fn no_selection_is_no_context_and_a_broken_one_an_error_without_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let env = vars(&[("XDG_CONFIG_HOME", dir.path().to_str().unwrap())]);
        assert_eq!(selected(&env).unwrap(), None);
        assert_eq!(selected(&vars(&[])).unwrap(), None);

        write(dir.path(), "nats/context.txt", "gone");
        let e = selected(&env).unwrap_err().0;
        assert!(e.contains("\"gone\"") && e.contains("gone.json"), "{e}");

        write(dir.path(), "nats/context.txt", "bad");
        write(
            dir.path(),
            "nats/context/bad.json",
            r#"{"password": "hunter2""#,
        );
        let e = selected(&env).unwrap_err().0;
        assert!(
            e.contains("not a context's JSON") && !e.contains("hunter2"),
            "{e}"
        );

        let e = selected(&vars(&[
            ("XDG_CONFIG_HOME", dir.path().to_str().unwrap()),
            (ENV_NATS_CONTEXT, "../x"),
        ]))
        .unwrap_err();
        assert!(e.0.contains("invalid nats context name"), "{e}");
    }

    #[test]
    fn credential_uris_other_than_files_are_refused_naming_the_context() {
        let c = NatsContext {
            name: "ngs".into(),
            path: "/cfg/nats/context/ngs.json".into(),
            creds: "op://vault/item/secret-field".into(),
            ..NatsContext::default()
        };
        let e = c.identity(&vars(&[])).unwrap_err().0;
        assert!(e.contains("ngs.json") && e.contains("`op:` URI"), "{e}");
        assert!(!e.contains("secret-field"), "{e}");
        let c = NatsContext {
            nkey: "file:///keys/u.nk".into(),
            ..NatsContext::default()
        };
        assert_eq!(
            c.identity(&vars(&[])).unwrap(),
            Some(ContextIdentity::NKeySeedFile("/keys/u.nk".into()))
        );
        let c = NatsContext {
            nkey: "data:;base64,U1UK".into(),
            ..NatsContext::default()
        };
        assert!(c.identity(&vars(&[])).is_err());
    }
}
