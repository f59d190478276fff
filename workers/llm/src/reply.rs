//! A `json` tool's reply: the JSON value in it, whether or not the model
//! wrapped it in a Markdown code fence.

use serde_json::Value;

/// How much of an unparseable reply an error quotes.
pub const QUOTE_CHARS: usize = 200;

/// A reply that is not the JSON the tool promised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the model's reply is not JSON ({reason}): {quoted}")]
pub struct ReplyError {
    pub reason: String,
    /// The reply, cut to [`QUOTE_CHARS`] characters (with `…` when cut).
    pub quoted: String,
}

/// The JSON value of `text`: the whole reply, or the inside of its one
/// code fence (```` ```json ```` or bare ```` ``` ````).
///
/// # Errors
///
/// [`ReplyError`] quoting the reply when it does not parse.
pub fn parse_json(text: &str) -> Result<Value, ReplyError> {
    let body = unfence(text.trim());
    serde_json::from_str(body).map_err(|e| ReplyError {
        reason: e.to_string(),
        quoted: quote(text),
    })
}

/// The inside of a reply wrapped in one code fence, else the reply.
fn unfence(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("```") else {
        return text;
    };
    // The info string (`json`, `JSON`, nothing) ends the first line.
    let Some((_, inside)) = rest.split_once('\n') else {
        return text;
    };
    inside
        .trim_end()
        .strip_suffix("```")
        .map_or(text, str::trim)
}

fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_and_fenced_replies_parse() {
        assert_eq!(parse_json(r#" {"a": 1} "#).unwrap(), json!({"a": 1}));
        assert_eq!(
            parse_json("```json\n{\"a\": [1, 2]}\n```").unwrap(),
            json!({"a": [1, 2]})
        );
        assert_eq!(parse_json("```\n[true]\n```\n").unwrap(), json!([true]));
        assert_eq!(parse_json("```JSON\n\"x\"\n```").unwrap(), json!("x"));
    }

    #[test]
    fn an_unparseable_reply_is_quoted_and_cut() {
        let e = parse_json("Sure! Here is the JSON: {\"a\": 1}").unwrap_err();
        assert!(e.quoted.starts_with("Sure! Here is"), "{e}");
        assert!(e.to_string().contains("not JSON"), "{e}");
        let long = "é".repeat(500);
        let e = parse_json(&long).unwrap_err();
        assert_eq!(e.quoted.chars().count(), QUOTE_CHARS + 1);
        assert!(e.quoted.ends_with('…'));
        // An unclosed fence is not a fence.
        assert!(parse_json("```json\n{\"a\": 1}").is_err());
    }
}
