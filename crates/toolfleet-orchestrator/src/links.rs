//! Link resolvers: a reference without a URL gets one from the template
//! configured for its type (`[links]` in the configuration file), e.g.
//! `data_source = "https://wiki.example.com/{source}"`. `{source}` is
//! percent-encoded per path segment (its `/` kept), `{title}` entirely.
//! Uploaded documents (`document`) are the user's own files: they never
//! get a link (the configuration refuses a template for them).

use std::collections::BTreeMap;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use toolfleet_protocol::Reference;

/// Everything but the unreserved characters of RFC 3986.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `reference` with its link resolved, when it has none and its type has a
/// template (and, for `{source}`, a source).
pub fn resolve(mut reference: Reference, templates: &BTreeMap<String, String>) -> Reference {
    if reference.url.is_some() || reference.kind == "document" {
        return reference;
    }
    let Some(template) = templates.get(&reference.kind) else {
        return reference;
    };
    let source = reference.source.as_deref();
    if template.contains("{source}") && source.is_none() {
        return reference;
    }
    let path = source
        .unwrap_or_default()
        .split('/')
        .map(|segment| utf8_percent_encode(segment, COMPONENT).to_string())
        .collect::<Vec<_>>()
        .join("/");
    let title = utf8_percent_encode(&reference.title, COMPONENT).to_string();
    reference.url = Some(
        template
            .replace("{source}", &path)
            .replace("{title}", &title),
    );
    reference
}

/// [`resolve`] over a list.
pub fn resolve_all(
    references: Vec<Reference>,
    templates: &BTreeMap<String, String>,
) -> Vec<Reference> {
    if templates.is_empty() {
        return references;
    }
    references
        .into_iter()
        .map(|r| resolve(r, templates))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(kind: &str, source: Option<&str>, url: Option<&str>) -> Reference {
        Reference {
            index: 1,
            kind: kind.into(),
            title: "Fog & light".into(),
            source: source.map(Into::into),
            url: url.map(Into::into),
            snippet: None,
            tool_id: None,
            call_id: None,
        }
    }

    #[test]
    fn templates_fill_links_by_type_and_never_for_uploads() {
        let templates = BTreeMap::from([
            (
                "data_source".to_owned(),
                "https://wiki.example.com/{source}".to_owned(),
            ),
            (
                "knowledge".to_owned(),
                "https://kb.example.com/search?q={title}".to_owned(),
            ),
            (
                "document".to_owned(),
                "https://never.example.com/{source}".to_owned(),
            ),
        ]);
        let r = resolve(
            reference("data_source", Some("ships/fog signals.md"), None),
            &templates,
        );
        assert_eq!(
            r.url.as_deref(),
            Some("https://wiki.example.com/ships/fog%20signals.md")
        );
        let r = resolve(reference("knowledge", None, None), &templates);
        assert_eq!(
            r.url.as_deref(),
            Some("https://kb.example.com/search?q=Fog%20%26%20light")
        );
        // An upload, a type without a template, a reference that has a URL,
        // a {source} template without a source: unchanged.
        assert_eq!(
            resolve(reference("document", Some("a.md"), None), &templates).url,
            None
        );
        assert_eq!(
            resolve(reference("event", Some("a"), None), &templates).url,
            None
        );
        assert_eq!(
            resolve(
                reference("data_source", Some("a"), Some("https://x/")),
                &templates
            )
            .url
            .as_deref(),
            Some("https://x/")
        );
        assert_eq!(
            resolve(reference("data_source", None, None), &templates).url,
            None
        );
    }
}
