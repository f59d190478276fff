//! Working through a tool's list of models: each attempt fires the start
//! hook, then complete or error; a failure with a model left fires
//! `on_fallback` and adds a `fallback` warning to the result; when every
//! model failed, the error (`fallback_exhausted`) lists each model with
//! its error. Models whose provider has no key are not attempted; when no
//! model has one, the call fails at once naming the missing keys
//! (`no_model_available`).

use toolfleet_llm::LlmClient;
use toolfleet_worker::{ToolCtx, ToolError};

use crate::providers::{Providers, split_model};

/// Code of the error when every model failed.
pub const FALLBACK_EXHAUSTED: &str = "fallback_exhausted";
/// Code of the error when no model of the list can be called at all.
pub const NO_MODEL_AVAILABLE: &str = "no_model_available";

/// Why one attempt failed, in words for the model and the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptError(pub String);

impl std::fmt::Display for AttemptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One model of the list that can be called.
#[derive(Clone, Copy)]
pub struct Candidate<'a> {
    /// `provider/model`.
    pub id: &'a str,
    /// The name sent to the provider.
    pub model: &'a str,
    pub client: &'a LlmClient,
    /// The deployment's fleet-wide limits, if it has any.
    pub limits: Option<&'a toolfleet_llm::gate::DeploymentLimits>,
    /// The deployment's `service_tier` for batch jobs, if it has one.
    pub batch_tier: Option<&'a str>,
}

/// The models of a call, worked through in order (see the module docs):
/// [`Attempts::plan`], then per candidate [`Attempts::started`] and
/// [`Attempts::succeeded`] or [`Attempts::failed`], and
/// [`Attempts::exhausted`] when none answered.
///
/// (A loop the caller writes rather than a function taking a closure: the
/// attempt's future borrows the streaming callback of the model client,
/// and a generic closure-returning-future loses those lifetimes.)
pub struct Attempts<'a> {
    usable: Vec<Candidate<'a>>,
    unusable: Vec<String>,
    failures: Vec<String>,
}

impl<'a> Attempts<'a> {
    /// The callable models of `models`, in order.
    ///
    /// # Errors
    ///
    /// `no_model_available`, naming why each model cannot be called, when
    /// none can.
    pub fn plan(providers: &'a Providers, models: &'a [String]) -> Result<Self, ToolError> {
        let mut usable = Vec::with_capacity(models.len());
        let mut unusable = Vec::new();
        for id in models {
            let Some((provider, model)) = split_model(id) else {
                unusable.push(format!("{id}: not provider/model"));
                continue;
            };
            match providers
                .get(provider)
                .map(|p| (&p.client, p.limits.as_ref(), p.batch_tier.as_deref()))
            {
                Some((Ok(client), limits, batch_tier)) => usable.push(Candidate {
                    id,
                    model,
                    client,
                    limits,
                    batch_tier,
                }),
                Some((Err(why), ..)) => unusable.push(format!("{id}: no API key ({why})")),
                None => unusable.push(format!("{id}: no deployment named {provider:?}")),
            }
        }
        if usable.is_empty() {
            return Err(ToolError::coded(
                NO_MODEL_AVAILABLE,
                format!(
                    "none of this tool's models can be called: {}",
                    if unusable.is_empty() {
                        "it lists none".to_owned()
                    } else {
                        unusable.join("; ")
                    }
                ),
            ));
        }
        Ok(Self {
            usable,
            unusable,
            failures: Vec::new(),
        })
    }

    /// The candidates, in order.
    #[must_use]
    pub fn candidates(&self) -> Vec<Candidate<'a>> {
        self.usable.clone()
    }

    /// Attempt `candidate` begins.
    pub fn started(&self, ctx: &ToolCtx, candidate: &Candidate<'_>) {
        ctx.attempt_started(candidate.id);
    }

    /// Attempt `candidate` answered.
    pub fn succeeded(&self, ctx: &ToolCtx, candidate: &Candidate<'_>) {
        ctx.attempt_completed(candidate.id);
    }

    /// Attempt number `index` failed with `error`: the error hook, and
    /// when a model remains, the fallback hook and a `fallback` warning.
    pub fn failed(&mut self, ctx: &ToolCtx, index: usize, error: &AttemptError) {
        let Some(candidate) = self.usable.get(index) else {
            return;
        };
        let id = candidate.id;
        tracing::info!(tool = %ctx.call().tool_id, model = id, error = %error, "model attempt failed");
        ctx.attempt_failed(id, &error.0);
        if let Some(next) = self.usable.get(index + 1) {
            ctx.fallback(id, next.id, &error.0);
            ctx.warning(
                "fallback",
                &format!("{id} failed ({error}); {} was tried next", next.id),
            );
        }
        self.failures.push(format!("{id}: {error}"));
    }

    /// The error when every candidate failed: each model with its error
    /// (and the models that could not be called, with why).
    #[must_use]
    pub fn exhausted(mut self) -> ToolError {
        self.failures.extend(self.unusable);
        ToolError::coded(
            FALLBACK_EXHAUSTED,
            format!("every model failed: {}", self.failures.join("; ")),
        )
    }
}
