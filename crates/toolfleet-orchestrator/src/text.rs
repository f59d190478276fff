//! Small text helpers the stages share: what events show of a call's
//! arguments, and text cut to a length.

use serde_json::Value;

/// Replaces the values of sensitive arguments.
pub(crate) fn redact(arguments: &Value, sensitive: &[String]) -> Value {
    let mut out = arguments.clone();
    if let Some(map) = out.as_object_mut() {
        for name in sensitive {
            if let Some(v) = map.get_mut(name) {
                *v = Value::String("[redacted]".into());
            }
        }
    }
    out
}

/// `text` cut to `max` characters, with `…` when cut.
pub(crate) fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_arguments_are_redacted() {
        let args = serde_json::json!({"query": "q", "apiToken": "s3cret"});
        let out = redact(&args, &["apiToken".to_string()]);
        assert_eq!(
            out,
            serde_json::json!({"query": "q", "apiToken": "[redacted]"})
        );
    }

    #[test]
    fn progress_messages_are_cut_on_a_character_boundary() {
        assert_eq!(shorten("short", 10), "short");
        assert_eq!(shorten("ééééé", 3), "ééé…");
        assert_eq!(shorten(&"x".repeat(10), 10), "x".repeat(10));
    }
}
