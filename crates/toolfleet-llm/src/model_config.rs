//! The model part of the fleet's configuration file: its
//! `[deployments.<name>]` tables ([`crate::deployments`]), its
//! `[prices."<model>"]` tables ([`crate::prices`]) and which deployment is
//! the default one (the default profile's first). A process that only calls
//! models, such as the LLM tools worker, reads this and nothing more.
//!
//! Every other table of the file (profiles and their policies, sinks,
//! links) is the orchestrator's: the `toolfleet-config` crate reads and
//! checks the whole file. Here those tables are skipped unread, so a
//! change to them never stops a model-only process.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::config_file::{self, ConfigError};
use crate::deployments::{self, Deployment};
use crate::prices::PriceTable;

/// The profile a file without `default_profile` (and a binary without a
/// config file) uses.
pub const DEFAULT_PROFILE: &str = "default";

/// The deployments and prices of the fleet's configuration file.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub deployments: BTreeMap<String, Deployment>,
    pub prices: PriceTable,
    /// The name of the default profile's first deployment, when the file
    /// has that profile; not checked against `deployments` here.
    pub default_name: Option<String>,
}

/// The file as this crate reads it: no `deny_unknown_fields`, since the
/// other tables are the orchestrator's.
#[derive(Deserialize)]
struct ModelFile {
    #[serde(default = "default_profile_name")]
    default_profile: String,
    #[serde(default)]
    deployments: BTreeMap<String, Deployment>,
    #[serde(default)]
    prices: PriceTable,
    #[serde(default)]
    profiles: BTreeMap<String, ProfileDeployments>,
}

/// Of a profile, only the deployments it names.
#[derive(Deserialize)]
struct ProfileDeployments {
    #[serde(default)]
    deployment: Option<String>,
    #[serde(default)]
    deployments: Vec<String>,
}

fn default_profile_name() -> String {
    DEFAULT_PROFILE.to_owned()
}

impl ModelConfig {
    /// Reads the model tables of a config file and checks them.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] of kind `Read` when the file cannot be read, `Parse`
    /// when it is not TOML or a model table is not of the expected shape,
    /// `Invalid` when a value is out of range.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let (text, origin) = config_file::read(path.as_ref())?;
        Self::from_toml(&text, &origin)
    }

    /// Parses and checks the model tables of config text; `origin` (a file
    /// name) goes into error messages.
    ///
    /// # Errors
    ///
    /// As [`ModelConfig::load`], without `Read`.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let mut file: ModelFile = config_file::parse(text, origin)?;
        deployments::validate_all(&file.deployments)
            .and_then(|()| file.prices.validate())
            .map_err(|problem| ConfigError::invalid(origin, problem))?;
        let default_name = file
            .profiles
            .remove(&file.default_profile)
            .and_then(|p| p.deployment.or_else(|| p.deployments.into_iter().next()));
        Ok(Self {
            deployments: file.deployments,
            prices: file.prices,
            default_name,
        })
    }

    /// One deployment, named [`DEFAULT_PROFILE`] and the default: what a
    /// binary without a config file runs with.
    pub fn single(deployment: Deployment) -> Self {
        Self {
            deployments: BTreeMap::from([(DEFAULT_PROFILE.to_owned(), deployment)]),
            prices: PriceTable::default(),
            default_name: Some(DEFAULT_PROFILE.to_owned()),
        }
    }

    /// The default deployment with its name, when it is configured.
    pub fn default_deployment(&self) -> Option<(&str, &Deployment)> {
        let name = self.default_name.as_deref()?;
        Some((name, self.deployments.get(name)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole file, as the orchestrator reads it.
    const EXAMPLE: &str = include_str!("../../../config/toolfleet.example.toml");

    #[test]
    fn the_example_file_gives_its_deployments_prices_and_default() {
        let config = ModelConfig::from_toml(EXAMPLE, "example").expect("loads");
        assert!(config.deployments.len() > 1);
        assert!(!config.prices.is_empty());
        let (name, deployment) = config.default_deployment().expect("a default");
        assert_eq!(Some(name), config.default_name.as_deref());
        assert!(!deployment.model.is_empty());
    }

    #[test]
    fn other_tables_are_skipped_but_model_tables_are_checked() {
        let text = "default_profile = \"main\"\n\
            [deployments.d]\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\n\
            [profiles.main]\ndeployments = [\"d\", \"e\"]\nnot_a_profile_key = 1\n\
            [sinks.s]\nwhatever = true\n[prices.m]\ninput = 1\noutput = 2\n";
        let config = ModelConfig::from_toml(text, "t.toml").expect("loads");
        assert_eq!(config.default_name.as_deref(), Some("d"));
        assert_eq!(config.default_deployment().map(|(n, _)| n), Some("d"));
        assert!(config.prices.get("m").is_some());

        let e = ModelConfig::from_toml(&text.replace("model = \"m\"", "model = \"\""), "t.toml")
            .expect_err("an empty model");
        assert_eq!(e.kind(), crate::config_file::ConfigErrorKind::Invalid);
        assert_eq!(e.key.as_deref(), Some("deployments.d.model"));
        let e = ModelConfig::from_toml(&text.replace("input = 1", "input = -1"), "t.toml")
            .expect_err("a negative price");
        assert_eq!(e.key.as_deref(), Some("prices.m.input"));
        let e = ModelConfig::from_toml(
            &format!("{text}[deployments.d.retry]\nmax_tries = 2\n"),
            "t",
        )
        .expect_err("an unknown deployment key");
        assert_eq!(e.kind(), crate::config_file::ConfigErrorKind::Parse);
    }

    #[test]
    fn no_default_profile_means_no_default_deployment() {
        let text = "[deployments.d]\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\n";
        let config = ModelConfig::from_toml(text, "t.toml").expect("loads");
        assert_eq!(config.default_name, None);
        let single = ModelConfig::single(config.deployments["d"].clone());
        assert_eq!(single.default_deployment().map(|(n, _)| n), Some("default"));
    }
}
