//! The models an LLM tool tries, in order, each once: the compat file's
//! recommended models for the tool (cheapest first), the definition's
//! preferred model, its fallback models — and the worker's default only
//! when all of those are empty. Ids are `provider/model`.

use toolfleet_worker::protocol::tools::ModelPreference;

/// The models to try, de-duplicated, in order (see the module docs).
#[must_use]
pub fn resolve(
    recommended: &[String],
    preference: Option<&ModelPreference>,
    default: Option<&str>,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let preferred = preference.and_then(|p| p.preferred_model.as_deref());
    let fallbacks = preference.map_or(&[][..], |p| p.fallback_models.as_slice());
    let candidates = recommended
        .iter()
        .map(String::as_str)
        .chain(preferred)
        .chain(fallbacks.iter().map(String::as_str));
    for model in candidates {
        if !out.iter().any(|m| m == model) {
            out.push(model.to_owned());
        }
    }
    if out.is_empty()
        && let Some(default) = default
    {
        out.push(default.to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pref(preferred: Option<&str>, fallbacks: &[&str]) -> ModelPreference {
        ModelPreference {
            preferred_model: preferred.map(str::to_owned),
            fallback_models: fallbacks.iter().map(|s| (*s).to_owned()).collect(),
            ..ModelPreference::default()
        }
    }

    #[test]
    fn compat_then_preferred_then_fallbacks_without_repeats() {
        let recommended = vec!["openai/gpt-4o-mini".to_owned(), "openai/gpt-4o".to_owned()];
        let p = pref(
            Some("openai/gpt-4o"),
            &["azure/gpt-4o", "openai/gpt-4o-mini"],
        );
        assert_eq!(
            resolve(&recommended, Some(&p), Some("local/llama")),
            ["openai/gpt-4o-mini", "openai/gpt-4o", "azure/gpt-4o"]
        );
    }

    #[test]
    fn the_default_only_when_nothing_else_is_named() {
        assert_eq!(resolve(&[], None, Some("local/llama")), ["local/llama"]);
        assert_eq!(
            resolve(&[], Some(&pref(None, &[])), Some("local/llama")),
            ["local/llama"]
        );
        assert_eq!(
            resolve(&[], Some(&pref(Some("a/b"), &[])), Some("local/llama")),
            ["a/b"]
        );
        assert!(resolve(&[], None, None).is_empty());
    }
}
