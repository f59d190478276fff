//! Secrets out of messages: URLs with their credentials hidden, the one
//! redaction every crate uses for a URL it shows (logs, errors, `Debug`);
//! and a tool call's sensitive arguments (its definition's
//! `sensitiveArguments`), the one redaction of arguments that events, dead
//! letters and the operator's commands share.

use serde_json::Value;

/// What stands in for a sensitive argument's value.
pub const REDACTED: &str = "[redacted]";

/// `arguments` with the value of every argument named in `sensitive`
/// replaced by [`REDACTED`] (the names are top-level properties of the
/// tool's parameters; arguments that are not an object are left as they
/// are).
#[must_use]
pub fn redact_arguments(arguments: &Value, sensitive: &[String]) -> Value {
    let mut out = arguments.clone();
    if let Some(map) = out.as_object_mut() {
        for name in sensitive {
            if let Some(v) = map.get_mut(name) {
                *v = Value::String(REDACTED.into());
            }
        }
    }
    out
}

/// `text` with every value of `arguments` named in `sensitive` replaced by
/// [`REDACTED`] where it appears (a string as written, any other scalar as
/// its JSON): for a text that may quote an argument, such as a tool's
/// error message. Empty values and values already [`REDACTED`] are left
/// alone.
#[must_use]
pub fn redact_argument_values(text: &str, arguments: &Value, sensitive: &[String]) -> String {
    let Some(map) = arguments.as_object() else {
        return text.to_string();
    };
    let mut values: Vec<String> = sensitive
        .iter()
        .filter_map(|name| map.get(name))
        .flat_map(scalars)
        .filter(|v| !v.is_empty() && v != REDACTED)
        .collect();
    // Longest first: a value inside another is not left half replaced.
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    values
        .iter()
        .fold(text.to_string(), |out, v| out.replace(v.as_str(), REDACTED))
}

/// The scalar texts inside `value` (a sensitive argument may be an object
/// or an array of secrets).
fn scalars(value: &Value) -> Vec<String> {
    match value {
        Value::Null => Vec::new(),
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().flat_map(scalars).collect(),
        Value::Object(map) => map.values().flat_map(scalars).collect(),
        other => vec![other.to_string()],
    }
}

/// A URL for people: any user info (a user and password, or a NATS token
/// in the user part) becomes `***`, and a query (which may carry a key) is
/// `[redacted]`; the rest stays as written. Text that is not a URL shows
/// nothing of itself.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let host = match authority.rfind('@') {
        Some(at) => format!("***@{}", &authority[at + 1..]),
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let fragment = query.find('#').map_or("", |f| &query[f..]);
            format!("{path}?[redacted]{fragment}")
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{host}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_arguments_are_redacted_in_arguments_and_in_text() {
        let args = serde_json::json!({"query": "q", "apiToken": "s3cret", "pin": 4711});
        let sensitive = ["apiToken".to_string(), "pin".to_string()];
        assert_eq!(
            redact_arguments(&args, &sensitive),
            serde_json::json!({"query": "q", "apiToken": "[redacted]", "pin": "[redacted]"})
        );
        assert_eq!(
            redact_argument_values("login with s3cret (pin 4711) for q", &args, &sensitive),
            "login with [redacted] (pin [redacted]) for q"
        );
        // Not an object: nothing to name.
        assert_eq!(redact_arguments(&Value::Null, &sensitive), Value::Null);
        assert_eq!(redact_argument_values("t", &Value::Null, &sensitive), "t");
    }

    #[test]
    fn credentials_and_queries_are_hidden() {
        assert_eq!(
            redact_url("redis://app:s3cr%40t@host:6379/2"),
            "redis://***@host:6379/2"
        );
        assert_eq!(
            redact_url("redis://:hunter2@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(
            redact_url("nats://s3cr3t-token@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_url("https://api.example.com/v1?api-key=k"),
            "https://api.example.com/v1?[redacted]"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(redact_url("not a url hunter2"), "<unparsable url>");
        assert_eq!(redact_url("http://:hunter2@x"), "http://***@x");
        assert_eq!(redact_url("redis://:hunter2@[bad"), "redis://***@[bad");
        assert_eq!(
            redact_url("https://u:p@h/a@b?k=v#top"),
            "https://***@h/a@b?[redacted]#top"
        );
    }
}
