//! Test fixtures shared by the modules' tests: the example file, the
//! README's snippets, two small files and a parser that names them
//! `test.toml`.

use std::collections::HashMap;

use crate::{ConfigError, FleetConfig};

/// The complete, commented example file.
pub(crate) const EXAMPLE: &str = include_str!("../../../config/toolfleet.example.toml");
/// The README, whose `toml` snippets must all load.
pub(crate) const PROVIDERS_DOC: &str = include_str!("../../../README.md");

pub(crate) const MINIMAL: &str = r#"
        [deployments.local]
        base_url = "http://127.0.0.1:11434/v1"
        model = "llama3.1:8b"

        [profiles.default]
        deployment = "local"
    "#;

/// Two deployments with keys, a profile that prefers the first.
pub(crate) const TWO: &str = r#"
        default_profile = "main"

        [deployments.primary]
        base_url = "https://api.openai.com/v1"
        model = "gpt-4o-mini"
        api_key_env = "PRIMARY_KEY"

        [deployments.backup]
        base_url = "https://backup.example.com/v1"
        model = "gpt-4o-mini"
        api_key_env = "BACKUP_KEY"

        [profiles.main]
        deployments = ["primary", "backup"]

        [profiles.other]
        orchestrator = "swarm"
        deployment = "backup"
    "#;

pub(crate) fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

pub(crate) fn parse(text: &str) -> Result<FleetConfig, ConfigError> {
    FleetConfig::from_toml(text, "test.toml")
}

pub(crate) fn parse_err(text: &str) -> ConfigError {
    parse(text).expect_err("the config should be refused")
}
