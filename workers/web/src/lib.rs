//! toolfleet-worker-web: web search and page reading for the model, with
//! every model-supplied argument treated as hostile. Written against the
//! worker SDK alone.
//!
//! - [`policy`]: the SSRF policy — the syntactic URL gate and the address
//!   gate (only global unicast addresses, unless the operator allows a
//!   host or CIDR).
//! - [`net`]: outbound HTTP that resolves once, checks every address and
//!   connects to a checked one ([`net::Resolve`] and [`net::Dial`] are
//!   replaceable, so tests never touch the network), follows and re-checks
//!   redirects, and caps bytes and time.
//! - [`html`]: a page's readable text through a real HTML parser.
//! - [`search`]: the DuckDuckGo, SearXNG and Brave backends.
//! - [`tools`]: `web:search` and `web:read_page`, configured from their
//!   definitions' `settingsSchema` (a settings file and, for the Brave
//!   key, the environment), and the `before_call` URL hook.

pub mod html;
pub mod net;
/// The SSRF policy lives in the service crate, shared with the
/// orchestrator's webhook sinks; the family reaches it through the SDK.
pub use toolfleet_worker::service::netpolicy as policy;
pub mod search;
pub mod tools;

use std::path::Path;
use std::sync::Arc;

use toolfleet_worker::protocol::tools::{self as defs, ToolDefinition};
use toolfleet_worker::settings::{SecretSource, SettingsFile};
use toolfleet_worker::{Worker, WorkerError};

use crate::net::{Dial, Resolve, SystemResolver, TcpDialer};
use crate::tools::{READ_PAGE_KEY, ReadPage, SEARCH_KEY, WebMetrics, WebSearch};

/// The family name (the worker's name in the catalog and services API).
pub const FAMILY: &str = "web";

/// How the worker reaches the network: the system's resolver and real
/// sockets, or stand-ins in tests.
#[derive(Clone)]
pub struct Network {
    pub resolver: Arc<dyn Resolve>,
    pub dialer: Arc<dyn Dial>,
}

impl Default for Network {
    fn default() -> Self {
        Self {
            resolver: Arc::new(SystemResolver),
            dialer: Arc::new(TcpDialer),
        }
    }
}

fn config(e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Config(e.to_string())
}

/// The web worker: the `web.*` definitions of `definitions`, each tool
/// built from its checked settings (`settings`, with secrets from
/// `secrets`). Every secret is scrubbed from what the worker publishes.
///
/// # Errors
///
/// [`WorkerError::Config`] for a missing definition, a settings table for
/// a tool not served, or a setting that is invalid or conflicts.
pub fn worker(
    definitions: &Path,
    settings: &SettingsFile,
    secrets: &dyn SecretSource,
    network: &Network,
) -> Result<Worker, WorkerError> {
    let all = defs::load_dir(definitions).map_err(config)?;
    let ours: Vec<&ToolDefinition> = all
        .iter()
        .filter(|d| [SEARCH_KEY, READ_PAGE_KEY].contains(&d.implementation_key.as_str()))
        .collect();
    settings.check_tools(ours.iter().copied()).map_err(config)?;
    let metrics = WebMetrics::new().map_err(config)?;
    let mut builder = Worker::builder(FAMILY).metrics(metrics.collector());
    let mut keys_seen = Vec::new();
    for definition in ours {
        let s = settings.tool(definition, secrets).map_err(config)?;
        builder = builder.definition(definition.clone()).secrets(s.secrets());
        let key = definition.implementation_key.as_str();
        if keys_seen.contains(&key) {
            // Several versions of one tool share one implementation (the
            // first version's settings would apply to all): refuse.
            return Err(config(format!(
                "two definitions have implementationKey {key:?}; the web worker serves one version of each tool"
            )));
        }
        keys_seen.push(key);
        if key == SEARCH_KEY {
            let tool = WebSearch::new(
                definition,
                &s,
                network.resolver.clone(),
                network.dialer.clone(),
            )
            .map_err(config)?
            .counting(metrics.clone());
            tracing::info!(backend = tool.backend(), "web search backend");
            builder = builder.tool(SEARCH_KEY, tool);
        } else {
            let tool = ReadPage::new(
                definition,
                &s,
                network.resolver.clone(),
                network.dialer.clone(),
            )
            .map_err(config)?
            .counting(metrics.clone());
            builder = builder.hooks(tool.url_policy()).tool(READ_PAGE_KEY, tool);
        }
    }
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn shipped() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions")
    }

    fn build(settings: &str, env: &[(&str, &str)]) -> Result<Worker, WorkerError> {
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        worker(
            &shipped(),
            &SettingsFile::parse(settings).unwrap(),
            &env,
            &Network::default(),
        )
    }

    #[test]
    fn the_worker_binds_the_shipped_definitions_with_default_settings() {
        let w = build("", &[]).unwrap();
        let mut ids: Vec<String> = w.definitions().map(|d| d.id.to_string()).collect();
        ids.sort();
        assert_eq!(ids, ["web:read_page@1.0.0", "web:search@1.0.0"]);
    }

    #[test]
    fn bad_and_conflicting_settings_are_clear_errors_at_start() {
        for (settings, env, expected) in [
            (
                "[\"web:search\"]\nbackend = \"brave\"\n",
                vec![],
                "needs braveApiKey: set TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY",
            ),
            (
                "[\"web:search\"]\nbackend = \"searxng\"\n",
                vec![],
                "needs searxngUrl",
            ),
            (
                "[\"web:search\"]\nsearxngUrl = \"http://searx:8080\"\n",
                vec![],
                "the backend is \"duckduckgo\"",
            ),
            (
                "[\"web:search\"]\nbackend = \"searxng\"\nsearxngUrl = \"not a url\"\n",
                vec![],
                "searxngUrl \"not a url\" is not a URL",
            ),
            (
                "[\"web:search\"]\nbackend = \"searxng\"\nsearxngUrl = \"ftp://x/\"\n",
                vec![],
                "http or https",
            ),
            (
                "[\"web:search\"]\nbackend = \"searxng\"\nsearxngUrl = \"http://u:canary-pw@searx/\"\n",
                vec![],
                "must not hold credentials",
            ),
            (
                "[\"web:read_page\"]\ntimeoutMs = 40000\n",
                vec![],
                "must be shorter than the tool's timeoutMs 30000",
            ),
            ("[\"web:read_page\"]\nmaxBytes = 10\n", vec![], "/maxBytes"),
            (
                "[\"web:read_page\"]\nallowCidrs = [\"10.0.0.0/33\"]\n",
                vec![],
                "allowCidrs: \"10.0.0.0/33\"",
            ),
            (
                "[\"web:read_page\"]\nallowedPorts = []\n",
                vec![],
                "/allowedPorts",
            ),
            (
                "[\"web:read_page\"]\nextraCaFile = \"/nonexistent.pem\"\n",
                vec![],
                "extra CA file /nonexistent.pem",
            ),
            (
                "[\"web:reed_page\"]\nmaxBytes = 2048\n",
                vec![],
                "does not serve",
            ),
            (
                "[\"web:search\"]\nbraveApiKey = \"canary-in-file\"\n",
                vec![],
                "is secret",
            ),
            (
                "",
                vec![("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "short")],
                "\"braveApiKey\" is not valid",
            ),
        ] {
            let e = build(settings, &env).unwrap_err().to_string();
            assert!(e.contains(expected), "{settings}: {e}");
            assert!(!e.contains("canary") && !e.contains("short\""), "{e}");
        }
        build(
            "[\"web:search\"]\nbackend = \"brave\"\n",
            &[("TOOLFLEET_WEB_SEARCH_BRAVE_API_KEY", "canary-key-1")],
        )
        .unwrap();
    }
}
