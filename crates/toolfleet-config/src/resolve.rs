//! Resolution: the profile a chat job names (or its tenant's default), if
//! its tenant may use it, on the first of its deployments whose key the
//! environment has, with the later ones as fallbacks
//! ([`ResolvedProfile`]). The deployment in use decides the trust the
//! invocation carries: its provider confidence, provider and connection
//! ([`ResolvedProfile::provider_confidence`]).
//!
//! # Invariants
//!
//! - **Resolution never reads the process environment directly**, only the
//!   [`EnvSource`] passed in, so it is testable without `set_var`.
//! - `Debug` of [`ResolvedProfile`] and [`ResolvedDeployment`] redacts the
//!   keys.

use std::fmt;

use toolfleet_llm::LlmConfig;
use toolfleet_llm::deployments::{Deployment, EnvSource};

use crate::errors::ResolveError;
use crate::file::FleetConfig;
use crate::profile::{DEFAULT_ORCHESTRATOR, ORCHESTRATORS, Profile};

impl FleetConfig {
    /// The profile a job of `tenant` named, or the tenant's default one;
    /// and the first of its deployments whose key is available in `env`.
    ///
    /// A missing or empty name is the tenant's default profile
    /// ([`FleetConfig::default_profile_of`]). A name that is not
    /// configured is refused, never replaced by the default.
    ///
    /// # Errors
    ///
    /// [`ResolveError::UnknownProfile`] when the job names a profile that
    /// does not exist; [`ResolveError::ProfileNotAllowed`] when the
    /// profile's `tenants` do not allow `tenant`;
    /// [`ResolveError::NoDeployment`] when no deployment of the profile is
    /// resolvable; [`ResolveError::NoProfile`] when the default profile
    /// does not exist (only possible for a config built in code). Each is
    /// fatal for the job: it ends at once with an `error` event.
    pub fn resolve(
        &self,
        tenant: &str,
        profile: Option<&str>,
        env: &dyn EnvSource,
    ) -> Result<ResolvedProfile, ResolveError> {
        self.resolve_among(tenant, profile, env, ORCHESTRATORS)
    }

    /// [`resolve`](Self::resolve), with the profile's orchestrator resolved
    /// among `orchestrators` (the names a process has registered) instead
    /// of [`ORCHESTRATORS`]; an unknown name still falls back to
    /// [`DEFAULT_ORCHESTRATOR`].
    pub fn resolve_among(
        &self,
        tenant: &str,
        profile: Option<&str>,
        env: &dyn EnvSource,
        orchestrators: &[&str],
    ) -> Result<ResolvedProfile, ResolveError> {
        let requested = profile.filter(|p| !p.is_empty());
        let (name, chosen) = self.choose(tenant, requested)?;
        let (orchestrator, orchestrator_fell_back) =
            match orchestrators.iter().find(|o| **o == chosen.orchestrator) {
                Some(known) => ((*known).to_owned(), false),
                None => (DEFAULT_ORCHESTRATOR.to_owned(), true),
            };

        let mut tried = Vec::new();
        let mut usable = Vec::new();
        for deployment_name in &chosen.deployments {
            let Some(deployment) = self.deployments.get(deployment_name) else {
                tried.push((deployment_name.clone(), "no such deployment".to_owned()));
                continue;
            };
            match deployment.api_key(env) {
                Ok(api_key) => usable.push(ResolvedDeployment {
                    name: deployment_name.clone(),
                    deployment: deployment.clone(),
                    api_key,
                }),
                // Skipped before the first usable one; after it, a
                // fallback that cannot be used is left out quietly.
                Err(why) if usable.is_empty() => {
                    tried.push((deployment_name.clone(), why.to_string()));
                }
                Err(_) => {}
            }
        }
        if usable.is_empty() {
            return Err(ResolveError::NoDeployment {
                profile: name.to_owned(),
                tried,
            });
        }
        let first = usable.remove(0);
        Ok(ResolvedProfile {
            name: name.to_owned(),
            requested: requested.map(str::to_owned),
            profile: chosen.clone(),
            deployment_name: first.name,
            deployment: first.deployment,
            orchestrator,
            orchestrator_fell_back,
            skipped: tried,
            api_key: first.api_key,
            fallbacks: usable,
        })
    }

    /// The profile a job of `tenant` runs: the one it named, else its
    /// tenant's default — if it exists and allows `tenant`.
    fn choose<'a>(
        &'a self,
        tenant: &str,
        requested: Option<&'a str>,
    ) -> Result<(&'a str, &'a Profile), ResolveError> {
        let name = requested.unwrap_or_else(|| self.default_profile_of(tenant));
        let chosen = match (self.profiles.get(name), requested) {
            (Some(chosen), _) => chosen,
            (None, Some(requested)) => {
                return Err(ResolveError::UnknownProfile {
                    requested: requested.to_owned(),
                });
            }
            (None, None) => {
                return Err(ResolveError::NoProfile {
                    requested: None,
                    default: name.to_owned(),
                });
            }
        };
        if !chosen.tenants.allows(tenant) {
            return Err(ResolveError::ProfileNotAllowed {
                profile: name.to_owned(),
                tenant: tenant.to_owned(),
                named: requested.is_some(),
            });
        }
        Ok((name, chosen))
    }
}

/// A profile resolved for one job: the deployment to call and its key.
#[derive(Clone, PartialEq)]
pub struct ResolvedProfile {
    /// The profile used.
    pub name: String,
    /// The name the job gave, if any (none: its tenant's default).
    pub requested: Option<String>,
    pub profile: Profile,
    pub deployment_name: String,
    pub deployment: Deployment,
    /// The orchestrator to run: one of the known names
    /// ([`ORCHESTRATORS`], or those given to [`FleetConfig::resolve_among`]).
    pub orchestrator: String,
    /// The profile named an unknown orchestrator; the default is used.
    pub orchestrator_fell_back: bool,
    /// Deployments tried before this one, with why each was skipped.
    pub skipped: Vec<(String, String)>,
    /// The key to send, if any. Redacted in `Debug`.
    pub api_key: Option<String>,
    /// The profile's later deployments that resolved too, in order: where
    /// a call goes when this deployment fails before any output
    /// ([`ResolvedProfile::next_deployment`]).
    pub fallbacks: Vec<ResolvedDeployment>,
}

/// A deployment with its key, resolved. `Debug` redacts the key.
#[derive(Clone, PartialEq)]
pub struct ResolvedDeployment {
    pub name: String,
    pub deployment: Deployment,
    pub api_key: Option<String>,
}

impl fmt::Debug for ResolvedDeployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedDeployment")
            .field("name", &self.name)
            .field("deployment", &self.deployment)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

impl fmt::Debug for ResolvedProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedProfile")
            .field("name", &self.name)
            .field("requested", &self.requested)
            .field("profile", &self.profile)
            .field("deployment_name", &self.deployment_name)
            .field("deployment", &self.deployment)
            .field("orchestrator", &self.orchestrator)
            .field("orchestrator_fell_back", &self.orchestrator_fell_back)
            .field("skipped", &self.skipped)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("fallbacks", &self.fallbacks)
            .finish()
    }
}

impl ResolvedProfile {
    /// The profile on its next resolved deployment, when there is one: the
    /// current one is recorded in `skipped` with `why`.
    #[must_use]
    pub fn next_deployment(&self, why: &str) -> Option<ResolvedProfile> {
        let mut rest = self.fallbacks.clone();
        if rest.is_empty() {
            return None;
        }
        let next = rest.remove(0);
        let mut skipped = self.skipped.clone();
        skipped.push((self.deployment_name.clone(), why.to_owned()));
        Some(ResolvedProfile {
            deployment_name: next.name,
            deployment: next.deployment,
            api_key: next.api_key,
            fallbacks: rest,
            skipped,
            ..self.clone()
        })
    }

    /// How much the fleet trusts the deployment in use, `0..=1`: the
    /// invocation's provider confidence (its `confidence`, 0 unless set).
    pub fn provider_confidence(&self) -> f64 {
        self.deployment.confidence
    }

    /// The provider label of the deployment in use: its `provider`, else
    /// its `base_url`'s host.
    pub fn provider(&self) -> String {
        self.deployment.provider_name()
    }

    /// The connection tool jobs carry: the deployment's name.
    pub fn connection(&self) -> &str {
        &self.deployment_name
    }

    /// The conversation model.
    pub fn model(&self) -> &str {
        &self.deployment.model
    }

    /// The model for the tool-planning call.
    pub fn utility_model(&self) -> &str {
        self.profile
            .utility_model
            .as_deref()
            .unwrap_or(&self.deployment.model)
    }

    /// The client config for the resolved deployment, with the resolved
    /// key.
    pub fn llm_config(&self) -> LlmConfig {
        self.deployment.llm_config_with_key(self.api_key.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use toolfleet_llm::{ApiShape, Auth, RetryPolicy};
    use url::Url;

    use super::*;
    use crate::ResolveError;
    use crate::testing::{EXAMPLE, MINIMAL, TWO, env, parse};

    #[test]
    fn later_usable_deployments_are_the_fallbacks_in_order() {
        let config = FleetConfig::from_toml(
            r#"
[deployments.a]
base_url = "http://a.example/v1"
model = "m-a"
[deployments.nokey]
base_url = "http://n.example/v1"
model = "m-n"
api_key_env = "TOOLFLEET_TEST_UNSET_KEY"
[deployments.b]
base_url = "http://b.example/v1"
model = "m-b"
api_key_env = "TOOLFLEET_TEST_B_KEY"
[profiles.default]
deployments = ["a", "nokey", "b"]
"#,
            "test",
        )
        .unwrap();
        let env: std::collections::HashMap<String, String> =
            [("TOOLFLEET_TEST_B_KEY".to_owned(), "sk-b-secret".to_owned())].into();
        let r = config.resolve("default", None, &env).unwrap();
        assert_eq!(r.deployment_name, "a");
        let names: Vec<&str> = r.fallbacks.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["b"], "the one without a key is left out");
        assert!(!format!("{r:?}").contains("sk-b-secret"), "{r:?}");
        let next = r.next_deployment("http_500").expect("b");
        assert_eq!(next.deployment_name, "b");
        assert_eq!(next.model(), "m-b");
        assert_eq!(next.api_key.as_deref(), Some("sk-b-secret"));
        assert_eq!(
            next.skipped.last().unwrap(),
            &("a".to_owned(), "http_500".to_owned())
        );
        assert!(next.next_deployment("again").is_none());
    }

    #[test]
    fn resolves_the_first_deployment_with_a_key() {
        let config = parse(TWO).expect("loads");
        let both = env(&[("PRIMARY_KEY", "k1"), ("BACKUP_KEY", "k2")]);
        let r = config
            .resolve("default", Some("main"), &both)
            .expect("resolves");
        assert_eq!(r.name, "main");
        assert_eq!(r.deployment_name, "primary");
        assert_eq!(r.api_key.as_deref(), Some("k1"));
        assert!(r.skipped.is_empty());
        assert_eq!(r.orchestrator, "agentic");

        let backup_only = env(&[("PRIMARY_KEY", "  \n"), ("BACKUP_KEY", "k2\n")]);
        let r = config
            .resolve("default", Some("main"), &backup_only)
            .expect("resolves");
        assert_eq!(r.deployment_name, "backup");
        assert_eq!(r.api_key.as_deref(), Some("k2"), "trimmed");
        assert_eq!(
            r.skipped,
            [(
                "primary".to_owned(),
                "environment variable PRIMARY_KEY is empty".to_owned()
            )]
        );
    }

    #[test]
    fn a_missing_profile_is_the_default_and_an_unknown_one_is_refused() {
        let config = parse(TWO).expect("loads");
        let both = env(&[("PRIMARY_KEY", "k1"), ("BACKUP_KEY", "k2")]);
        for asked in [None, Some("")] {
            let r = config.resolve("acme", asked, &both).expect("resolves");
            assert_eq!(r.name, "main", "{asked:?}");
            assert_eq!(r.requested, None);
        }
        let e = config
            .resolve("acme", Some("nope"), &both)
            .expect_err("never the default instead");
        assert_eq!(e.code(), "unknown_profile");
        assert_eq!(
            e.to_string(),
            "no profile named \"nope\" is configured; the job is not run on another one"
        );
    }

    const TENANTS: &str = r#"
        [deployments.plain]
        base_url = "https://plain.example/v1"
        model = "m"
        [deployments.trusted]
        base_url = "https://api.openai.com/v1"
        model = "m"
        confidence = 0.9
        provider = "openai"
        [profiles.default]
        deployment = "plain"
        [profiles.acme-only]
        deployment = "trusted"
        tenants = ["acme"]
        [profiles.globex-private]
        deployments = ["plain", "trusted"]
        tenants = ["globex"]
        [tenants.acme]
        default_profile = "acme-only"
        trust_user = true
        [tenants.initech]
    "#;

    #[test]
    fn each_tenant_gets_its_default_and_only_the_profiles_it_may_use() {
        let config = parse(TENANTS).expect("loads");
        let none = HashMap::new();
        let r = config.resolve("acme", None, &none).expect("acme's default");
        assert_eq!(r.name, "acme-only");
        assert_eq!(r.provider_confidence(), 0.9);
        assert_eq!(r.provider(), "openai");
        assert_eq!(r.connection(), "trusted");
        // A tenant without its own default gets the file's.
        for tenant in ["globex", "initech", "default"] {
            let r = config.resolve(tenant, None, &none).expect("the default");
            assert_eq!(r.name, "default", "{tenant}");
            assert_eq!(r.provider_confidence(), 0.0);
            assert_eq!(r.provider(), "plain.example", "the host by default");
        }
        assert!(config.trusts_user("acme"));
        assert!(!config.trusts_user("globex") && !config.trusts_user("initech"));

        let e = config
            .resolve("acme", Some("globex-private"), &none)
            .expect_err("globex's profile");
        assert_eq!(e.code(), "profile_not_allowed");
        assert_eq!(
            e,
            ResolveError::ProfileNotAllowed {
                profile: "globex-private".into(),
                tenant: "acme".into(),
                named: true
            }
        );
        assert!(e.to_string().contains("may not use profile"), "{e}");
        let e = config
            .resolve("globex", Some("acme-only"), &none)
            .expect_err("acme's profile");
        assert_eq!(e.code(), "profile_not_allowed");
        let r = config
            .resolve("globex", Some("globex-private"), &none)
            .expect("its own");
        // The deployment in use decides the trust, fallbacks included.
        assert_eq!((r.connection(), r.provider_confidence()), ("plain", 0.0));
        let next = r.next_deployment("http_500").expect("a fallback");
        assert_eq!(
            (next.connection(), next.provider_confidence()),
            ("trusted", 0.9)
        );

        // A fleet default a tenant may not use is refused, saying how to
        // give it one.
        let narrow = parse(&TENANTS.replace(
            "[profiles.default]\n        deployment = \"plain\"",
            "[profiles.default]\n        deployment = \"plain\"\n        tenants = [\"acme\"]",
        ))
        .expect("loads");
        let e = narrow
            .resolve("globex", None, &none)
            .expect_err("no default");
        assert_eq!(e.code(), "profile_not_allowed");
        assert!(e.to_string().contains("[tenants.globex]"), "{e}");
    }

    #[test]
    fn unknown_orchestrator_falls_back_to_agentic() {
        let config = parse(TWO).expect("loads");
        let r = config
            .resolve("default", Some("other"), &env(&[("BACKUP_KEY", "k2")]))
            .expect("resolves");
        assert_eq!(r.name, "other");
        assert_eq!(r.orchestrator, "agentic");
        assert!(r.orchestrator_fell_back);
        assert!(config.warnings().iter().any(|w| w.contains("\"swarm\"")));
    }

    #[test]
    fn no_resolvable_deployment_names_the_profile_and_why() {
        let config = parse(TWO).expect("loads");
        let e = config
            .resolve("default", Some("main"), &env(&[("BACKUP_KEY", "")]))
            .expect_err("nothing resolvable");
        assert_eq!(e.code(), "no_deployment");
        assert_eq!(
            e,
            ResolveError::NoDeployment {
                profile: "main".into(),
                tried: vec![
                    (
                        "primary".into(),
                        "environment variable PRIMARY_KEY is not set".into()
                    ),
                    (
                        "backup".into(),
                        "environment variable BACKUP_KEY is empty".into()
                    ),
                ],
            }
        );
        assert_eq!(
            e.to_string(),
            "profile \"main\" has no usable deployment: primary (environment variable \
             PRIMARY_KEY is not set); backup (environment variable BACKUP_KEY is empty)"
        );
    }

    #[test]
    fn a_deployment_without_key_variable_needs_no_key() {
        let config = parse(MINIMAL).expect("loads");
        let r = config
            .resolve("default", None, &HashMap::new())
            .expect("resolves");
        assert_eq!(r.api_key, None);
        assert_eq!(r.utility_model(), "llama3.1:8b");
        let llm = r.llm_config();
        assert_eq!(llm.api_key, None);
        assert_eq!(llm.base_url.as_str(), "http://127.0.0.1:11434/v1");
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let config = parse(TWO).expect("loads");
        let r = config
            .resolve("default", None, &env(&[("PRIMARY_KEY", "sk-very-secret")]))
            .expect("resolves");
        assert!(!format!("{r:?}").contains("sk-very-secret"));
        let d = Deployment::new(
            Url::parse("https://api.openai.com/v1").expect("url"),
            "gpt-4o",
        )
        .with_api_key("sk-very-secret");
        assert!(!format!("{d:?}").contains("sk-very-secret"));
        assert!(!format!("{:?}", FleetConfig::single(d)).contains("sk-very-secret"));
    }

    #[test]
    fn every_deployment_setting_reaches_the_client_config() {
        let config = parse(EXAMPLE).expect("loads");
        let vars = env(&[("AZURE_OPENAI_API_KEY", "az-key")]);
        let llm = config.deployments["azure"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(
            llm.base_url.as_str(),
            "https://my-resource.openai.azure.com/openai/deployments/gpt-4o-mini"
        );
        assert_eq!(llm.api_key.as_deref(), Some("az-key"));
        assert_eq!(llm.api, ApiShape::ChatCompletions);
        assert_eq!(llm.auth, Auth::Header("api-key".into()));
        assert_eq!(
            llm.extra_query,
            [("api-version".to_owned(), "2024-10-21".to_owned())]
        );

        let vars = env(&[("OPENAI_API_KEY", "oa-key")]);
        let llm = config.deployments["openai"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.auth, Auth::Bearer);
        assert!(llm.stream);
        assert!(llm.extra_query.is_empty());
        assert_eq!(llm.connect_timeout, Duration::from_millis(5000));
        assert_eq!(llm.first_token_timeout, Duration::from_millis(60000));
        assert_eq!(llm.idle_timeout, Duration::from_millis(30000));
        assert_eq!(
            llm.retry,
            RetryPolicy {
                max_attempts: 3,
                max_elapsed: Duration::from_millis(30000),
                base_delay: Duration::from_millis(250),
                max_delay: Duration::from_millis(5000),
            }
        );
        assert!(!llm.reasoning);
        let llm = config.deployments["openai-responses"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.api, ApiShape::Responses);
        assert!(!llm.reasoning, "gpt-4o is not a reasoning model");
        let llm = config.deployments["openai-reasoning"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.api, ApiShape::Responses);
        assert!(llm.reasoning);
        let resolved = config
            .resolve("default", Some("deep"), &vars)
            .expect("the reasoning profile resolves");
        assert!(resolved.llm_config().reasoning);

        let config =
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nstream = false"))
                .expect("loads");
        let llm = config.deployments["local"]
            .to_llm_config(&HashMap::new())
            .expect("llm config");
        assert!(!llm.stream);
        assert_eq!(llm.api_key, None);
        assert_eq!(llm.http, toolfleet_llm::HttpVersion::Http1);
        let config =
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nhttp = \"http2\""))
                .expect("loads");
        let llm = config.deployments["local"]
            .to_llm_config(&HashMap::new())
            .expect("llm config");
        assert_eq!(llm.http, toolfleet_llm::HttpVersion::Http2);
        assert!(
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nhttp = \"3\""))
                .is_err()
        );
    }
}
