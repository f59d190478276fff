//! Canonical JSON: one text for one value, whatever order its objects'
//! keys came in — what a digest of a JSON value (a cache key, a tool
//! definition's pin) is taken over.
//!
//! `serde_json` prints a `Value`'s object keys sorted only while no crate
//! of the build enables its `preserve_order` feature; this does not depend
//! on that.

use serde_json::Value;

/// `value` as canonical JSON: object keys sorted at every depth, no
/// whitespace, strings escaped and numbers printed as `serde_json` does —
/// so `{"b":1,"a":2}` and `{"a":2,"b":1}` are one text.
#[must_use]
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write(value, &mut out);
    out
}

fn write(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_at_every_depth_and_arrays_keep_their_order() {
        let a = json!({"b": 1, "a": {"y": [2, {"d": 1, "c": "x\"y"}], "x": null}});
        let b = json!({"a": {"x": null, "y": [2, {"c": "x\"y", "d": 1}]}, "b": 1});
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"x":null,"y":[2,{"c":"x\"y","d":1}]},"b":1}"#
        );
        assert_ne!(
            canonical_json(&json!([1, 2])),
            canonical_json(&json!([2, 1]))
        );
    }
}
