//! Sinks: named places the events of invocations also go to — a signed
//! webhook, a relay subject on another NATS prefix, or both — that a
//! profile (or a chat job) routes its answers to. Delivery is the
//! orchestrator's; this is what the file may say about them.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[sinks.<name>]` | table | a webhook and/or relay the events of invocations also go to; names are `[A-Za-z0-9_.-]+` |
//! | `sinks.<name>.url` | https URL, none | the webhook each routed event is POSTed to, signed (HMAC-SHA256); no credentials in it; the orchestrator's SSRF policy applies at start and at every delivery |
//! | `sinks.<name>.secret_env` | env var name, required with `url` | the variable holding the signing secret (never the secret itself) |
//! | `sinks.<name>.events` | `"final"` (default) or `"all"` | the terminal event only, or every event but the deltas |
//! | `sinks.<name>.relay` | NATS subject, none | a subject on another prefix the events are published to (no wildcards; not under the fleet's prefix, checked at the orchestrator's start) |
//! | `sinks.<name>.tenants` | list of tenant names or `["*"]`, `["*"]` | the tenants whose answers may go to it: a profile's sink must allow every tenant the profile allows (checked at load) |
//! | `profiles.<name>.sink` | sink name, none | the sink this profile's events also go to (a chat job's own `sink` wins) |

use serde::Deserialize;
use toolfleet_llm::config_file::is_env_var_name;
use url::Url;

use crate::tenants::TenantScope;

/// A named sink (`[sinks.<name>]`): a webhook, a relay subject, or both.
/// The secret is never in the file: `secret_env` names the variable.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// The webhook the events are POSTed to (https; http only when the
    /// orchestrator allows it for tests).
    #[serde(default)]
    pub url: Option<String>,
    /// The environment variable holding the webhook's signing secret;
    /// required with `url`.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// Only the terminal event (`final`, the default) or all but deltas.
    #[serde(default)]
    pub events: toolfleet_protocol::SinkEvents,
    /// A NATS subject on another prefix the events are published to.
    #[serde(default)]
    pub relay: Option<String>,
    /// The tenants whose answers may go to it.
    #[serde(default)]
    pub tenants: TenantScope,
}

impl SinkConfig {
    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if self.url.is_none() && self.relay.is_none() {
            return Err((at.to_owned(), "names neither `url` nor `relay`".to_owned()));
        }
        if let Some(raw) = &self.url {
            let url = Url::parse(raw)
                .map_err(|e| (format!("{at}.url"), format!("{raw:?} is not a URL ({e})")))?;
            if !matches!(url.scheme(), "https" | "http") || url.host_str().is_none() {
                return Err((
                    format!("{at}.url"),
                    "must be an https:// URL with a host".to_owned(),
                ));
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err((
                    format!("{at}.url"),
                    "must not hold credentials (user:password@)".to_owned(),
                ));
            }
            match &self.secret_env {
                None => {
                    return Err((
                        format!("{at}.secret_env"),
                        "a webhook is always signed: name the environment variable that holds \
                         its secret"
                            .to_owned(),
                    ));
                }
                Some(name) if !is_env_var_name(name) => {
                    return Err((
                        format!("{at}.secret_env"),
                        format!(
                            "{name:?} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
                        ),
                    ));
                }
                Some(_) => {}
            }
        } else if self.secret_env.is_some() {
            return Err((
                format!("{at}.secret_env"),
                "only a webhook (`url`) is signed".to_owned(),
            ));
        }
        if let Some(relay) = &self.relay {
            let tokens_ok = !relay.is_empty()
                && relay.split('.').all(|t| {
                    !t.is_empty() && t != "*" && t != ">" && !t.chars().any(char::is_whitespace)
                });
            if !tokens_ok {
                return Err((
                    format!("{at}.relay"),
                    format!("{relay:?} is not a NATS subject without wildcards"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::ConfigErrorKind;
    use crate::testing::{parse, parse_err};

    #[test]
    fn sinks_are_parsed_and_checked_with_the_key_path() {
        const DEPLOYMENT: &str =
            "[deployments.local]\nbase_url = \"http://127.0.0.1:11434/v1\"\nmodel = \"m\"\n";
        let ok = parse(&format!(
            r#"{DEPLOYMENT}
            [profiles.default]
            deployment = "local"
            sink = "acme"
            [sinks.acme]
            url = "https://hooks.acme.example/toolfleet"
            secret_env = "TOOLFLEET_SINK_ACME_SECRET"
            events = "all"
            [sinks.bus]
            relay = "acme.answers"
            "#
        ))
        .expect("a config with sinks");
        assert_eq!(ok.profiles["default"].sink.as_deref(), Some("acme"));
        let acme = &ok.sinks["acme"];
        assert_eq!(acme.events, toolfleet_protocol::SinkEvents::All);
        assert_eq!(
            acme.secret_env.as_deref(),
            Some("TOOLFLEET_SINK_ACME_SECRET")
        );
        assert_eq!(
            ok.sinks["bus"].events,
            toolfleet_protocol::SinkEvents::Final
        );
        assert_eq!(ok.sinks["bus"].relay.as_deref(), Some("acme.answers"));

        for (sink, key, says) in [
            ("", "sinks.s", "neither"),
            (
                "url = \"https://h.example/x\"",
                "sinks.s.secret_env",
                "always signed",
            ),
            (
                "url = \"https://h.example/x\"\nsecret_env = \"1BAD\"",
                "sinks.s.secret_env",
                "not an environment",
            ),
            (
                "url = \"ftp://h.example/x\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "https",
            ),
            (
                "url = \"https://u:p@h.example/x\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "credentials",
            ),
            (
                "url = \"not a url\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "not a URL",
            ),
            ("relay = \"acme.*\"", "sinks.s.relay", "wildcards"),
            ("relay = \"acme..x\"", "sinks.s.relay", "wildcards"),
            (
                "relay = \"a.b\"\nsecret_env = \"S\"",
                "sinks.s.secret_env",
                "only a webhook",
            ),
        ] {
            let e = parse_err(&format!(
                "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\n[sinks.s]\n{sink}\n"
            ));
            assert_eq!(e.key.as_deref(), Some(key), "{sink}: {e}");
            assert!(e.to_string().contains(says), "{sink}: {e}");
        }
        let e = parse_err(&format!(
            "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\nsink = \"nope\"\n"
        ));
        assert_eq!(e.key.as_deref(), Some("profiles.default.sink"), "{e}");
        assert!(e.to_string().contains("no sink named"), "{e}");
        let e = parse_err(&format!(
            "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\n[sinks.s]\nrelay = \"a.b\"\nsecret = \"x\"\n"
        ));
        assert_eq!(e.kind(), ConfigErrorKind::Parse, "{e}");
    }
}
