//! Which variant of a definition serves a model: the first variant (by
//! name) whose `models` match the `provider/model` in use, else the one
//! marked `default`, else the first; none when the definition has no
//! variants (its own prompt serves).

use toolfleet_worker::protocol::tools::{ToolDefinition, ToolVariant};

/// Whether `pattern` (`provider/model`, `provider/*` or `*`) covers
/// `model` (`provider/model`).
#[must_use]
pub fn matches(pattern: &str, model: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    match pattern.strip_suffix("/*") {
        Some(provider) => model.split_once('/').is_some_and(|(p, _)| p == provider),
        None => pattern == model,
    }
}

/// The variant of `definition` for `model` (see the module docs), with its
/// name.
#[must_use]
pub fn choose<'d>(
    definition: &'d ToolDefinition,
    model: &str,
) -> Option<(&'d str, &'d ToolVariant)> {
    let variants = &definition.variants;
    variants
        .iter()
        .find(|(_, v)| v.models.iter().any(|p| matches(p, model)))
        .or_else(|| variants.iter().find(|(_, v)| v.default))
        .or_else(|| variants.iter().next())
        .map(|(name, v)| (name.as_str(), v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolfleet_worker::protocol::tools::Origin;

    fn definition(variants: serde_json::Value) -> ToolDefinition {
        ToolDefinition::from_value(
            json!({
                "schemaVersion": 1, "id": "llm:t@1.0.0", "implementationKey": "llm.t",
                "title": "t", "description": "d", "category": "text",
                "systemPrompt": "You help.", "userTemplate": "{{text}}",
                "function": { "name": "t", "description": "d", "parameters": {
                    "type": "object", "properties": { "text": { "type": "string" } } } },
                "variants": variants
            }),
            Origin::Named("t".into()),
        )
        .unwrap()
    }

    #[test]
    fn patterns_match_provider_and_model() {
        assert!(matches("*", "openai/gpt-4o"));
        assert!(matches("openai/*", "openai/gpt-4o"));
        assert!(!matches("openai/*", "azure/gpt-4o"));
        assert!(matches("openai/gpt-4o", "openai/gpt-4o"));
        assert!(!matches("openai/gpt-4o", "openai/gpt-4o-mini"));
    }

    #[test]
    fn a_match_then_the_default_then_the_first() {
        let d = definition(json!({
            "azure": { "models": ["azure/*"], "systemPrompt": "Azure." },
            "brief": { "default": true, "systemPrompt": "Brief." },
            "local": { "models": ["local/llama3.1:8b"], "systemPrompt": "Local." }
        }));
        assert_eq!(choose(&d, "azure/gpt-4o").unwrap().0, "azure");
        assert_eq!(choose(&d, "local/llama3.1:8b").unwrap().0, "local");
        assert_eq!(choose(&d, "openai/gpt-4o").unwrap().0, "brief");
        let no_default = definition(json!({
            "b": { "models": ["azure/*"] },
            "a": { "models": ["local/*"] }
        }));
        assert_eq!(
            choose(&no_default, "openai/x").unwrap().0,
            "a",
            "the first by name"
        );
        assert!(choose(&definition(json!({})), "openai/x").is_none());
    }
}
