//! JSON Schema validators: compiled once, used at the boundaries (inbound
//! jobs, tool arguments, model tool calls).
//!
//! Invariants:
//!
//! - Nothing here touches the network or the file system. Every schema is
//!   compiled with a retriever that refuses every external URI, so a `$ref`
//!   to `http://…`, `https://…` or `file://…` is a compile error
//!   ([`SchemaErrorKind::ExternalReference`]), never a request. References
//!   inside the same schema (including `$id`-based ones) and the meta-schemas
//!   of every supported draft (shipped inside the `jsonschema` crate) resolve
//!   offline.
//! - Draft 2020-12 is the default; a `$schema` keyword selects another draft.
//! - A [`Validator`] is cheap to clone (it shares the compiled schema) and is
//!   `Send + Sync`, so one compiled validator serves every task of a process.
//! - Validation failures come back as [`Violation`]s: the JSON pointer of the
//!   failing instance location plus a message, which [`describe`] turns into
//!   the model-readable error text a worker returns to the LLM.

use std::fmt;
use std::sync::Arc;

use jsonschema::error::ValidationErrorKind;
use serde_json::Value;

/// Longest message kept per violation. Some messages embed the failing
/// instance (`{…} is not of type "string"`); an argument of megabytes must not
/// become an error text of megabytes sent back to the model or into logs.
const MAX_MESSAGE_CHARS: usize = 300;

/// Most violations [`describe`] lists before summarising the rest: the model
/// needs the first few to repair its call, not hundreds.
const MAX_DESCRIBED_VIOLATIONS: usize = 20;

/// A compiled JSON Schema.
///
/// Compile once with [`Validator::compile`] (at start-up or when a tool
/// catalog is built), then clone freely: clones share the compiled schema.
#[derive(Clone)]
pub struct Validator {
    inner: Arc<jsonschema::Validator>,
}

impl fmt::Debug for Validator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The compiled tree is large and says nothing useful in a log line.
        f.debug_struct("Validator")
            .field("draft", &self.inner.draft())
            .finish_non_exhaustive()
    }
}

impl Validator {
    /// Compile `schema`.
    ///
    /// Draft 2020-12 unless the schema's `$schema` names another draft. No
    /// external `$ref` is ever fetched: a reference that does not resolve
    /// inside `schema` (or to a built-in meta-schema) fails with
    /// [`SchemaErrorKind::ExternalReference`].
    ///
    /// # Errors
    ///
    /// [`SchemaError`] when the schema is not a valid JSON Schema, refers to
    /// an external resource, or has a reference that does not resolve.
    pub fn compile(schema: &Value) -> Result<Self, SchemaError> {
        let inner = jsonschema::options()
            .with_retriever(RefuseAll)
            .build(schema)
            .map_err(|error| SchemaError::from_build_error(&error))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Validate `instance`, returning every violation found.
    ///
    /// # Errors
    ///
    /// The violations, in the order the validator reports them (never
    /// empty).
    pub fn validate(&self, instance: &Value) -> Result<(), Vec<Violation>> {
        // `is_valid` short-circuits and allocates nothing: the common, valid
        // case stays cheap; errors are collected only when there are some.
        if self.inner.is_valid(instance) {
            return Ok(());
        }
        let violations: Vec<Violation> = self
            .inner
            .iter_errors(instance)
            .map(|error| Violation::new(error.instance_path().as_str(), &error.to_string()))
            .collect();
        if violations.is_empty() {
            // Defensive: the crate's fast and full paths should agree; if they
            // ever do not, refuse rather than let an invalid instance through.
            return Err(vec![Violation::new(
                "",
                "the value does not match the schema",
            )]);
        }
        Err(violations)
    }

    /// Whether `instance` is valid: the fast path when the reasons do not
    /// matter.
    #[must_use]
    pub fn is_valid(&self, instance: &Value) -> bool {
        self.inner.is_valid(instance)
    }
}

/// Refuses every external resource. The `jsonschema` crate asks its
/// retriever only for URIs that are neither in the schema itself nor among
/// the built-in meta-schemas, so refusing all of them is exactly "no remote
/// `$ref` resolution" — and it holds even if some other crate in the build
/// turns on the crate's HTTP or file features.
struct RefuseAll;

impl jsonschema::Retrieve for RefuseAll {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        Err(Box::new(ExternalRefRefused {
            uri: uri.as_str().to_owned(),
        }))
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "external reference `{uri}` refused: schemas may only refer to themselves or to \
     built-in meta-schemas (no network or file access)"
)]
struct ExternalRefRefused {
    uri: String,
}

/// One reason an instance does not match a schema.
// Deserialize too: violations travel inside tool error envelopes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Violation {
    /// JSON pointer (RFC 6901) of the failing location in the instance; the
    /// empty string is the root. [`Display`](fmt::Display) shows the root as
    /// `/`.
    pub path: String,
    /// What is wrong, e.g. `50 is greater than the maximum of 10`.
    pub message: String,
}

impl Violation {
    /// A violation at `path` (a JSON pointer, `""` for the root), with the
    /// message cut to a bounded length.
    #[must_use]
    pub fn new(path: &str, message: &str) -> Self {
        Self {
            path: path.to_owned(),
            message: truncate(message, MAX_MESSAGE_CHARS),
        }
    }

    /// The path as shown to people and models: the pointer, or `/` for the
    /// root.
    #[must_use]
    pub fn display_path(&self) -> &str {
        if self.path.is_empty() {
            "/"
        } else {
            &self.path
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at {}: {}", self.display_path(), self.message)
    }
}

/// The model-readable text for a list of violations: one line per violation
/// (`at /limit: 50 is greater than the maximum of 10`), at most
/// 20 lines, then a count of the rest.
#[must_use]
pub fn describe(violations: &[Violation]) -> String {
    let mut lines: Vec<String> = violations
        .iter()
        .take(MAX_DESCRIBED_VIOLATIONS)
        .map(ToString::to_string)
        .collect();
    if violations.len() > MAX_DESCRIBED_VIOLATIONS {
        lines.push(format!(
            "… and {} more violations",
            violations.len() - MAX_DESCRIBED_VIOLATIONS
        ));
    }
    lines.join("\n")
}

fn truncate(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}…", &text[..cut]),
    }
}

/// What kind of [`SchemaError`] happened; small and comparable so callers can
/// match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SchemaErrorKind {
    /// The schema refers to a resource outside itself.
    ExternalReference,
    /// A reference inside the schema does not resolve.
    UnresolvableReference,
    /// The schema is not a valid JSON Schema (fails its meta-schema, bad
    /// regex, unknown draft, …).
    InvalidSchema,
}

/// A schema that could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// The schema refers to `uri`, outside itself; such references are never
    /// fetched.
    #[error(
        "schema refers to external resource `{uri}`, which is not allowed: only references \
         inside the schema itself and to built-in meta-schemas resolve (no network or file access)"
    )]
    ExternalReference {
        /// The URI the schema referred to.
        uri: String,
    },
    /// A `$ref`, anchor or JSON pointer inside the schema leads nowhere.
    #[error("schema has a reference that does not resolve: {message}")]
    UnresolvableReference {
        /// What the resolver said.
        message: String,
    },
    /// The schema itself is invalid.
    #[error("invalid JSON Schema at {}: {message}", display_pointer(path))]
    Invalid {
        /// JSON pointer of the offending location inside the schema (`""` =
        /// the root).
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl SchemaError {
    /// The kind, for callers that decide by type.
    #[must_use]
    pub fn kind(&self) -> SchemaErrorKind {
        match self {
            Self::ExternalReference { .. } => SchemaErrorKind::ExternalReference,
            Self::UnresolvableReference { .. } => SchemaErrorKind::UnresolvableReference,
            Self::Invalid { .. } => SchemaErrorKind::InvalidSchema,
        }
    }

    /// JSON pointer inside the schema where the problem is, when known.
    #[must_use]
    pub fn path(&self) -> Option<&str> {
        match self {
            Self::Invalid { path, .. } => Some(path),
            Self::ExternalReference { .. } | Self::UnresolvableReference { .. } => None,
        }
    }

    fn from_build_error(error: &jsonschema::ValidationError<'_>) -> Self {
        match error.kind() {
            ValidationErrorKind::Referencing(reference) => match reference {
                jsonschema::ReferencingError::Unretrievable { uri, .. } => {
                    Self::ExternalReference { uri: uri.clone() }
                }
                other => Self::UnresolvableReference {
                    message: other.to_string(),
                },
            },
            _ => Self::Invalid {
                path: error.instance_path().as_str().to_owned(),
                message: truncate(&error.to_string(), MAX_MESSAGE_CHARS),
            },
        }
    }
}

fn display_pointer(path: &str) -> &str {
    if path.is_empty() { "/" } else { path }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::{Path, PathBuf};

    fn suite_dir() -> PathBuf {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/conformance/json-schema-test-suite/draft2020-12"
        ))
    }

    fn suite_files(dir: &Path) -> Vec<PathBuf> {
        let mut files = Vec::new();
        let entries = std::fs::read_dir(dir).unwrap_or_else(|error| {
            panic!(
                "JSON-Schema-Test-Suite directory {} is missing or unreadable ({error}); \
                 it lives in the shared/ folder beside the repository (see \
                 shared/conformance/SOURCES.md)",
                dir.display()
            )
        });
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                files.extend(suite_files(&path));
            } else if path.extension().is_some_and(|ext| ext == "json") {
                files.push(path);
            }
        }
        files.sort();
        files
    }

    #[test]
    fn json_schema_test_suite_draft2020_12() {
        let dir = suite_dir();
        let files = suite_files(&dir);
        assert!(
            files.iter().any(|f| f.ends_with("ref.json")),
            "expected ref.json among the suite files in {}",
            dir.display()
        );
        assert!(
            files
                .iter()
                .any(|f| f.parent().is_some_and(|p| p.ends_with("optional"))),
            "expected the optional/ cases in {}",
            dir.display()
        );
        let mut failures = Vec::new();
        let mut cases = 0usize;
        for file in &files {
            let text = std::fs::read_to_string(file).expect("read suite file");
            let groups: Vec<Value> = serde_json::from_str(&text).expect("suite file is JSON");
            let name = file
                .strip_prefix(&dir)
                .unwrap_or(file)
                .display()
                .to_string();
            for group in groups {
                let description = group["description"].as_str().unwrap_or("?");
                let tests = group["tests"].as_array().expect("tests array");
                let validator = match Validator::compile(&group["schema"]) {
                    Ok(validator) => validator,
                    Err(error) => {
                        failures.push(format!("{name}: {description}: schema failed: {error}"));
                        cases += tests.len();
                        continue;
                    }
                };
                for test in tests {
                    cases += 1;
                    let expected = test["valid"].as_bool().expect("valid flag");
                    let actual = validator.is_valid(&test["data"]);
                    // `validate` must agree with `is_valid`, and explain
                    // every rejection.
                    let explained = validator.validate(&test["data"]);
                    if actual != expected || explained.is_ok() != expected {
                        failures.push(format!(
                            "{name}: {description}: {}: expected valid={expected}, \
                             is_valid={actual}, validate={:?}",
                            test["description"].as_str().unwrap_or("?"),
                            explained
                        ));
                    }
                }
            }
        }
        assert!(cases > 0, "no test cases found in {}", dir.display());
        assert!(
            failures.is_empty(),
            "{} of {cases} suite cases failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn remote_ref_is_refused_without_a_request() {
        let schema = json!({"$ref": "http://169.254.169.254/latest"});
        let error = Validator::compile(&schema).expect_err("remote $ref must not compile");
        assert_eq!(error.kind(), SchemaErrorKind::ExternalReference);
        let text = error.to_string();
        assert!(text.contains("http://169.254.169.254/latest"), "{text}");
        assert!(text.contains("not allowed"), "{text}");
    }

    #[test]
    fn remote_ref_to_a_local_listener_is_never_connected() {
        // A listener we own on loopback: if compiling tried to fetch the
        // reference, a connection would be waiting in the backlog.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("local addr").port();
        for uri in [
            format!("http://127.0.0.1:{port}/schema.json"),
            format!("https://127.0.0.1:{port}/schema.json"),
        ] {
            let schema = json!({
                "type": "object",
                "properties": {"x": {"$ref": uri}}
            });
            let error = Validator::compile(&schema).expect_err("remote $ref must not compile");
            assert_eq!(error.kind(), SchemaErrorKind::ExternalReference, "{error}");
        }
        match listener.accept() {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            Ok((_, peer)) => panic!("compiling a schema connected to the network (from {peer})"),
            Err(error) => panic!("unexpected accept error: {error}"),
        }
    }

    #[test]
    fn file_ref_is_refused() {
        let schema = json!({"$ref": "file:///etc/passwd"});
        let error = Validator::compile(&schema).expect_err("file $ref must not compile");
        assert_eq!(error.kind(), SchemaErrorKind::ExternalReference);
        assert!(error.to_string().contains("file:///etc/passwd"));
    }

    #[test]
    fn local_refs_and_ids_resolve_offline() {
        let schema = json!({
            "$id": "http://example.com/root.json",
            "$defs": {
                "positive": {"$id": "positive.json", "type": "integer", "minimum": 1}
            },
            "properties": {
                "a": {"$ref": "#/$defs/positive"},
                "b": {"$ref": "positive.json"}
            }
        });
        let validator = Validator::compile(&schema).expect("local refs resolve");
        assert!(validator.is_valid(&json!({"a": 1, "b": 2})));
        assert!(!validator.is_valid(&json!({"a": 0})));
        assert!(!validator.is_valid(&json!({"b": "x"})));
    }

    #[test]
    fn dangling_local_ref_is_a_clear_error() {
        let schema = json!({"$ref": "#/$defs/missing"});
        let error = Validator::compile(&schema).expect_err("dangling ref");
        assert_eq!(
            error.kind(),
            SchemaErrorKind::UnresolvableReference,
            "{error}"
        );
        assert!(error.to_string().contains("missing"), "{error}");
    }

    #[test]
    fn invalid_schema_names_its_location() {
        let schema = json!({"type": "object", "properties": {"limit": {"minimum": "ten"}}});
        let error = Validator::compile(&schema).expect_err("invalid schema");
        assert_eq!(error.kind(), SchemaErrorKind::InvalidSchema);
        assert_eq!(error.path(), Some("/properties/limit/minimum"), "{error}");
        assert!(
            error.to_string().contains("/properties/limit/minimum"),
            "{error}"
        );
    }

    #[test]
    fn default_draft_is_2020_12_and_schema_keyword_is_respected() {
        // `prefixItems` exists only since 2020-12: with the default draft it
        // constrains the first item.
        let default =
            Validator::compile(&json!({"prefixItems": [{"type": "integer"}]})).expect("compiles");
        assert!(!default.is_valid(&json!(["x"])));
        // Under draft 7 the array form of `items` applies instead, and
        // `prefixItems` is an unknown keyword.
        let draft7 = Validator::compile(&json!({
            "$schema": "http://json-schema.org/draft-07/schema#",
            "items": [{"type": "integer"}]
        }))
        .expect("compiles");
        assert!(!draft7.is_valid(&json!(["x"])));
        assert!(draft7.is_valid(&json!([1, "x"])));
        let draft7_prefix = Validator::compile(&json!({
            "$schema": "http://json-schema.org/draft-07/schema#",
            "prefixItems": [{"type": "integer"}]
        }))
        .expect("compiles");
        assert!(draft7_prefix.is_valid(&json!(["x"])));
    }

    #[test]
    fn validate_reports_pointer_and_message() {
        let validator = Validator::compile(&json!({
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "limit": {"type": "integer", "maximum": 10}
            },
            "required": ["query"],
            "additionalProperties": false
        }))
        .expect("compiles");
        assert!(
            validator
                .validate(&json!({"query": "rust", "limit": 3}))
                .is_ok()
        );

        let violations = validator
            .validate(&json!({"limit": 50}))
            .expect_err("invalid");
        assert!(
            violations
                .iter()
                .any(|v| v.path == "/limit" && v.message.contains("maximum of 10")),
            "{violations:?}"
        );
        assert!(
            violations
                .iter()
                .any(|v| v.path.is_empty() && v.message.contains("\"query\"")),
            "{violations:?}"
        );
        let text = describe(&violations);
        assert!(
            text.lines()
                .any(|l| l == "at /limit: 50 is greater than the maximum of 10"),
            "{text}"
        );
        assert!(text.lines().any(|l| l.starts_with("at /: ")), "{text}");
        assert_eq!(text.lines().count(), violations.len());
    }

    #[test]
    fn violation_display_and_serialize() {
        let violation = Violation::new("/limit", "50 is greater than the maximum of 10");
        assert_eq!(
            violation.to_string(),
            "at /limit: 50 is greater than the maximum of 10"
        );
        assert_eq!(Violation::new("", "bad").to_string(), "at /: bad");
        assert_eq!(
            serde_json::to_value(&violation).expect("serialize"),
            json!({"path": "/limit", "message": "50 is greater than the maximum of 10"})
        );
    }

    #[test]
    fn long_messages_and_many_violations_are_bounded() {
        let validator = Validator::compile(&json!({"type": "array", "items": {"type": "string"}}))
            .expect("compiles");
        let huge = Value::Array(
            (0..100)
                .map(|i| json!({"n": i, "pad": "x".repeat(1000)}))
                .collect(),
        );
        let violations = validator.validate(&huge).expect_err("invalid");
        assert_eq!(violations.len(), 100);
        assert!(
            violations
                .iter()
                .all(|v| v.message.chars().count() <= MAX_MESSAGE_CHARS + 1)
        );
        let text = describe(&violations);
        assert_eq!(text.lines().count(), MAX_DESCRIBED_VIOLATIONS + 1);
        assert!(text.ends_with("… and 80 more violations"), "{text}");
    }

    #[test]
    fn validator_is_send_sync_and_clone_shares() {
        fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}
        assert_send_sync::<Validator>();
        let validator = Validator::compile(&json!({"type": "string"})).expect("compiles");
        let clone = validator.clone();
        assert!(Arc::ptr_eq(&validator.inner, &clone.inner));
        let handle = std::thread::spawn(move || clone.is_valid(&json!("x")));
        assert!(handle.join().expect("thread"));
    }
}
