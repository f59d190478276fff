//! The providers an LLM tool reaches: one pooled HTTP client per deployment
//! of the fleet's configuration, built once when the worker starts, and
//! the reason a deployment cannot be used (its key is missing) when it
//! cannot.

use std::collections::BTreeMap;

use toolfleet_llm::LlmClient;
use toolfleet_llm::deployments::EnvSource;
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_llm::prices::PriceTable;

/// A deployment as the worker uses it.
pub(crate) struct Provider {
    /// The client, or why there is none (the key is not set).
    pub(crate) client: Result<LlmClient, String>,
}

/// Every deployment of the configuration, by name, and the price table.
pub struct Providers {
    by_name: BTreeMap<String, Provider>,
    pub(crate) prices: PriceTable,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("names", &self.by_name.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Providers {
    /// One client per deployment of `config`, with its key from `env`. A
    /// deployment whose key is missing is kept, without a client, so a
    /// call can say which key is missing.
    ///
    /// # Errors
    ///
    /// A client that cannot be built (a key that cannot go in a header).
    pub fn new(config: &ModelConfig, env: &dyn EnvSource) -> Result<Self, String> {
        let mut by_name = BTreeMap::new();
        for (name, deployment) in &config.deployments {
            let client = match deployment.to_llm_config(env) {
                Ok(llm) => {
                    Ok(LlmClient::new(llm).map_err(|e| format!("deployment {name:?}: {e}"))?)
                }
                Err(why) => Err(why.to_string()),
            };
            by_name.insert(name.clone(), Provider { client });
        }
        Ok(Self {
            by_name,
            prices: config.prices.clone(),
        })
    }

    pub(crate) fn get(&self, provider: &str) -> Option<&Provider> {
        self.by_name.get(provider)
    }

    /// Whether `provider` is a deployment of the configuration.
    #[must_use]
    pub fn knows(&self, provider: &str) -> bool {
        self.by_name.contains_key(provider)
    }

    /// The deployment names, for messages.
    pub fn names(&self) -> String {
        self.by_name.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// `provider/model` split in two; `None` when it is not of that form.
#[must_use]
pub fn split_model(id: &str) -> Option<(&str, &str)> {
    id.split_once('/')
        .filter(|(p, m)| !p.is_empty() && !m.is_empty())
}
