//! The prompt of a declarative LLM tool: its system prompt and its user
//! message, rendered from the call's validated arguments.
//!
//! `userTemplate` is a [minijinja] template (`{{variable}}`, filters,
//! conditionals), compiled once when the worker starts. A template naming a
//! variable the tool's input schema does not declare is refused then, with
//! the definition and the field (`userTemplate`, or
//! `variants.<name>.userTemplate`), so a typo never reaches a model. Before
//! rendering, the input schema's top-level `default`s fill the arguments
//! the model left out; an optional argument that is still absent renders
//! as nothing (and is false in `{% if %}`), so a template can speak of it
//! conditionally.

use std::collections::BTreeSet;

use minijinja::{Environment, UndefinedBehavior};
use serde_json::{Map, Value};
use toolfleet_worker::protocol::tools::ToolDefinition;

/// The template name of the tool's own prompt in the environment.
const OWN: &str = "userTemplate";

/// A definition that cannot be run as an LLM tool, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{tool}: {field}: {message}")]
pub struct PromptError {
    /// The tool's id.
    pub tool: String,
    /// Where in the definition, e.g. `variants.brief.userTemplate`.
    pub field: String,
    pub message: String,
}

/// The compiled prompts of one definition: its own and each variant's.
pub struct Prompts {
    env: Environment<'static>,
    tool: String,
    system: Option<String>,
    variants: Vec<(String, Option<String>)>,
    defaults: Map<String, Value>,
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompts")
            .field("tool", &self.tool)
            .field("variants", &self.variants.len())
            .finish_non_exhaustive()
    }
}

/// One call's rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub system: Option<String>,
    pub user: String,
}

impl Prompts {
    /// Compiles the prompts of `definition`.
    ///
    /// # Errors
    ///
    /// [`PromptError`] naming the field: no `userTemplate`, a template
    /// that does not parse, or one naming a variable the input schema
    /// (`function.parameters.properties`) does not declare.
    pub fn compile(definition: &ToolDefinition) -> Result<Self, PromptError> {
        let tool = definition.id.to_string();
        let declared: BTreeSet<String> = definition
            .function
            .parameters
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        // Prompts are plain text: never HTML-escape an argument, whatever a
        // template's name looks like.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        let own = definition
            .user_template
            .clone()
            .ok_or_else(|| PromptError {
                tool: tool.clone(),
                field: OWN.into(),
                message: "an LLM tool needs a userTemplate".into(),
            })?;
        add(&mut env, &tool, OWN, own, &declared)?;
        let mut variants = Vec::new();
        for (name, variant) in &definition.variants {
            let field = format!("variants.{name}.userTemplate");
            if let Some(template) = &variant.user_template {
                add(&mut env, &tool, &field, template.clone(), &declared)?;
            }
            variants.push((
                name.clone(),
                variant
                    .system_prompt
                    .clone()
                    .or_else(|| definition.system_prompt.clone()),
            ));
        }
        let defaults = definition
            .function
            .parameters
            .get("properties")
            .and_then(Value::as_object)
            .map(|props| {
                props
                    .iter()
                    .filter_map(|(k, schema)| Some((k.clone(), schema.get("default")?.clone())))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            env,
            tool,
            system: definition.system_prompt.clone(),
            variants,
            defaults,
        })
    }

    /// The prompt for `arguments` (already validated against the input
    /// schema), with the tool's own templates or those of variant
    /// `variant` (its fields falling back to the tool's).
    ///
    /// # Errors
    ///
    /// [`PromptError`] when rendering fails (a variable the arguments
    /// lack), naming the template.
    pub fn render(
        &self,
        variant: Option<&str>,
        arguments: &Value,
    ) -> Result<Rendered, PromptError> {
        let mut args = match arguments {
            Value::Object(map) => map.clone(),
            _ => Map::new(),
        };
        for (k, v) in &self.defaults {
            args.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let (field, system) = match variant.and_then(|name| {
            self.variants
                .iter()
                .find(|(n, _)| n == name)
                .map(|(n, system)| (format!("variants.{n}.userTemplate"), system.clone()))
        }) {
            Some((field, system)) if self.env.get_template(&field).is_ok() => (field, system),
            Some((_, system)) => (OWN.to_owned(), system),
            None => (OWN.to_owned(), self.system.clone()),
        };
        let fail = |message: String| PromptError {
            tool: self.tool.clone(),
            field: field.clone(),
            message,
        };
        let template = self
            .env
            .get_template(&field)
            .map_err(|e| fail(e.to_string()))?;
        let user = template
            .render(Value::Object(args))
            .map_err(|e| fail(format!("cannot render: {e}")))?;
        Ok(Rendered { system, user })
    }
}

/// Parses `source` into `env` under `field` and checks its variables.
fn add(
    env: &mut Environment<'static>,
    tool: &str,
    field: &str,
    source: String,
    declared: &BTreeSet<String>,
) -> Result<(), PromptError> {
    let fail = |message: String| PromptError {
        tool: tool.to_owned(),
        field: field.to_owned(),
        message,
    };
    env.add_template_owned(field.to_owned(), source)
        .map_err(|e| fail(format!("not a valid template: {e}")))?;
    let template = env.get_template(field).map_err(|e| fail(e.to_string()))?;
    let unknown: Vec<String> = template
        .undeclared_variables(false)
        .into_iter()
        .filter(|v| !declared.contains(v))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if !unknown.is_empty() {
        return Err(fail(format!(
            "names {} that the input schema does not declare (function.parameters.properties: {})",
            unknown.join(", "),
            declared.iter().cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolfleet_worker::protocol::tools::Origin;

    fn definition(user: &str, variants: Value) -> ToolDefinition {
        ToolDefinition::from_value(
            json!({
                "schemaVersion": 1, "id": "llm:summarize@1.0.0", "implementationKey": "llm.summarize",
                "title": "Summarize", "description": "d", "category": "text",
                "systemPrompt": "You summarize faithfully.",
                "userTemplate": user,
                "function": { "name": "summarize", "description": "d", "parameters": {
                    "type": "object",
                    "properties": {
                        "text": { "type": "string" },
                        "style": { "type": "string", "default": "neutral" }
                    },
                    "required": ["text"] } },
                "variants": variants
            }),
            Origin::Named("summarize".into()),
        )
        .unwrap()
    }

    #[test]
    fn the_template_renders_the_arguments_with_defaults_filled() {
        let p = Prompts::compile(&definition(
            "Summarize ({{ style }}):\n\n{{ text }}{% if text|length > 5 %} (long){% endif %}",
            json!({}),
        ))
        .unwrap();
        let r = p.render(None, &json!({ "text": "abcdefg" })).unwrap();
        assert_eq!(r.user, "Summarize (neutral):\n\nabcdefg (long)");
        assert_eq!(r.system.as_deref(), Some("You summarize faithfully."));
        let r = p
            .render(None, &json!({ "text": "ab", "style": "terse" }))
            .unwrap();
        assert_eq!(r.user, "Summarize (terse):\n\nab");
    }

    #[test]
    fn arguments_are_rendered_as_they_are() {
        let p = Prompts::compile(&definition("{{ text }}", json!({}))).unwrap();
        let r = p
            .render(None, &json!({ "text": "<b>Tom & \"Jerry\"</b>" }))
            .unwrap();
        assert_eq!(r.user, "<b>Tom & \"Jerry\"</b>");
    }

    #[test]
    fn a_variant_overrides_the_template_and_system_prompt() {
        let p = Prompts::compile(&definition(
            "{{ text }}",
            json!({
                "brief": { "systemPrompt": "Three sentences.", "userTemplate": "Briefly: {{ text }}" },
                "same": { "default": true }
            }),
        ))
        .unwrap();
        let r = p.render(Some("brief"), &json!({ "text": "x" })).unwrap();
        assert_eq!(r.user, "Briefly: x");
        assert_eq!(r.system.as_deref(), Some("Three sentences."));
        let r = p.render(Some("same"), &json!({ "text": "x" })).unwrap();
        assert_eq!(r.user, "x");
        assert_eq!(r.system.as_deref(), Some("You summarize faithfully."));
    }

    #[test]
    fn a_variable_the_schema_lacks_is_refused_naming_the_field() {
        let e =
            Prompts::compile(&definition("{{ text }} in {{ language }}", json!({}))).unwrap_err();
        assert_eq!(e.field, "userTemplate");
        assert!(e.to_string().contains("language"), "{e}");
        assert!(e.to_string().starts_with("llm:summarize@1.0.0"), "{e}");
        let e = Prompts::compile(&definition(
            "{{ text }}",
            json!({ "v": { "userTemplate": "{{ tone }}" } }),
        ))
        .unwrap_err();
        assert_eq!(e.field, "variants.v.userTemplate");
        let e = Prompts::compile(&definition("{{ text", json!({}))).unwrap_err();
        assert!(e.message.contains("not a valid template"), "{e}");
    }
}
