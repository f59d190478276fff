//! What can go wrong with the configuration: a file that cannot be used
//! ([`ConfigError`], at load, from the LLM client crate that reads the same
//! file) and a profile that cannot be used for one job ([`ResolveError`], at
//! resolution, when the environment lacks a key).

pub use toolfleet_llm::config_file::{ConfigError, ConfigErrorKind};

/// A profile that cannot be used for a job: fatal for that job, which ends
/// at once with an `error` event carrying [`ResolveError::code`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// None of the profile's deployments is resolvable.
    #[error("profile {profile:?} has no usable deployment: {}", describe_tried(.tried))]
    NoDeployment {
        profile: String,
        /// Each deployment tried, with why it could not be used.
        tried: Vec<(String, String)>,
    },
    /// The default profile does not exist.
    #[error("no profile {default:?} (the default) is configured{}", requested_note(.requested))]
    NoProfile {
        requested: Option<String>,
        default: String,
    },
    /// The job names a profile that is not configured (it is never run on
    /// another one instead).
    #[error("no profile named {requested:?} is configured; the job is not run on another one")]
    UnknownProfile { requested: String },
    /// The profile (the one the job named, or its tenant's default) does
    /// not allow the job's tenant.
    #[error("{}", not_allowed(.profile, .tenant, *.named))]
    ProfileNotAllowed {
        profile: String,
        tenant: String,
        /// The job named it (else it is the tenant's default).
        named: bool,
    },
}

impl ResolveError {
    /// The `error` event's code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoDeployment { .. } => "no_deployment",
            Self::NoProfile { .. } => "no_profile",
            Self::UnknownProfile { .. } => "unknown_profile",
            Self::ProfileNotAllowed { .. } => "profile_not_allowed",
        }
    }
}

fn describe_tried(tried: &[(String, String)]) -> String {
    if tried.is_empty() {
        return "it names no deployment".to_owned();
    }
    tried
        .iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn requested_note(requested: &Option<String>) -> String {
    match requested {
        Some(r) => format!(" and profile {r:?} does not exist"),
        None => String::new(),
    }
}

fn not_allowed(profile: &str, tenant: &str, named: bool) -> String {
    if named {
        format!("tenant {tenant:?} may not use profile {profile:?}")
    } else {
        format!(
            "tenant {tenant:?} may not use the default profile {profile:?}: name a profile it \
             may use, or have the operator set `default_profile` under [tenants.{tenant}]"
        )
    }
}
