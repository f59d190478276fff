//! [`Settings`]: how this orchestrator process runs — the subjects, the
//! profiles file, where keys are read, limits and timings. Read by every
//! stage through [`Fleet::config`](crate::Fleet::config); built by
//! [`OrchestratorConfig`](crate::OrchestratorConfig), which also holds what
//! a deployment registers (orchestrators, context handlers).

use std::sync::Arc;
use std::time::Duration;

use toolfleet_config::FleetConfig;
use toolfleet_llm::deployments::{EnvSource, ProcessEnv};
use toolfleet_protocol::Subjects;

use crate::sinks::SinkSettings;
use crate::tools::declared::DeclaredPools;

/// How long batch jobs wait behind interactive ones at most, by default
/// (`--batch-max-wait`).
pub const DEFAULT_BATCH_MAX_WAIT: Duration = Duration::from_secs(30);

/// Room a delayed job keeps in the chat stream after its run's deadline,
/// for a redelivery should the orchestrator running it die (the ack
/// wait, a second attempt): an hour.
pub const NOT_BEFORE_ROOM: Duration = Duration::from_secs(3600);

/// The most `--max-not-before-secs` may be: the chat stream's `max_age`
/// ([`CHAT_MAX_AGE`](toolfleet_protocol::streams::CHAT_MAX_AGE), a day)
/// less [`NOT_BEFORE_ROOM`] — 23 h. A job waiting longer would be deleted
/// by the stream before it ran, with no event at all. Each job's own limit
/// is also less its timeout (`intake::delay`).
pub const MAX_NOT_BEFORE_CEILING: Duration = Duration::from_secs(
    toolfleet_protocol::streams::CHAT_MAX_AGE.as_secs() - NOT_BEFORE_ROOM.as_secs(),
);

/// How far ahead a chat job's `notBefore` may be, by default
/// (`--max-not-before-secs`): [`MAX_NOT_BEFORE_CEILING`], 23 h (less the
/// job's timeout).
pub const DEFAULT_MAX_NOT_BEFORE: Duration = MAX_NOT_BEFORE_CEILING;

/// Refuses a `--max-not-before-secs` past [`MAX_NOT_BEFORE_CEILING`]
/// (or zero), saying why: the start stops rather than accept jobs the
/// chat stream would delete unrun.
pub fn check_max_not_before(max: Duration) -> Result<(), String> {
    if max.is_zero() || max > MAX_NOT_BEFORE_CEILING {
        return Err(format!(
            "--max-not-before-secs {} must be 1 to {}: a job waits in the chat stream, which \
             deletes it {} s after its submission, and its run and a redelivery need the last \
             {} s of that (use a schedule for later times)",
            max.as_secs(),
            MAX_NOT_BEFORE_CEILING.as_secs(),
            toolfleet_protocol::streams::CHAT_MAX_AGE.as_secs(),
            NOT_BEFORE_ROOM.as_secs()
        ));
    }
    Ok(())
}

/// A tenant's chat jobs waiting for their `notBefore` at once, by default
/// (`--max-delayed-jobs`): each stays pending on a chat consumer, whose
/// `max_ack_pending` is 10 000 (with FIFO dispatch, one consumer shared
/// by every tenant).
pub const DEFAULT_MAX_DELAYED_JOBS: u64 = 1000;

/// How chat jobs are taken from the chat stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ChatDispatch {
    /// Per-tenant consumers taken in weighted turns, interactive before
    /// batch (the default).
    #[default]
    Fair,
    /// One consumer shared by every tenant, in arrival order: no fairness,
    /// no priorities. For a fleet with one tenant, or to measure what
    /// fairness costs (`toolfleet bench --mode noisy`). The chat stream may
    /// not hold fair dispatch's consumers then.
    Fifo,
}

/// How the orchestrator runs. Model endpoints, prompts and loop policies
/// come from the profiles ([`FleetConfig`]), resolved per chat job.
#[derive(Clone)]
pub struct Settings {
    pub subjects: Subjects,
    pub profiles: Arc<FleetConfig>,
    /// Where API-key variables are read.
    pub env: Arc<dyn EnvSource + Send + Sync>,
    /// Chat jobs worked on at once by this process.
    pub max_in_flight: usize,
    /// The longest batch jobs wait behind interactive ones: past it, fair
    /// dispatch takes a batch job next (aging, so batch never starves).
    pub batch_max_wait: Duration,
    /// Fair dispatch (the default), or one shared FIFO.
    pub chat_dispatch: ChatDispatch,
    /// Deadline of a chat job that names none.
    pub default_timeout: Duration,
    /// Added to a tool's own timeout while waiting for its result (queueing,
    /// transport).
    pub tool_wait_slack: Duration,
    /// How often the live worker catalog is read.
    pub catalog_refresh: Duration,
    /// How long a catalog reading collects answers.
    pub catalog_wait: Duration,
    /// Recommended models per tool (`--tool-compat`), joined to the
    /// registry on every rebuild.
    pub compat: Option<Arc<toolfleet_protocol::registry::CompatFile>>,
    /// Webhook and relay sinks: retries, SSRF exceptions, allowed relays.
    pub sinks: SinkSettings,
    /// The tools of the pools the profiles file declares, offered while
    /// none of their workers is live (scale from zero): none until
    /// [`DeclaredPools::load`] resolves them from definition files.
    pub declared: DeclaredPools,
    /// How threads and idempotency keys are kept (`docs/threads.md`).
    pub threads: crate::threads::store::ThreadSettings,
    /// How far ahead a chat job's `notBefore` may be (further: refused).
    pub max_not_before: Duration,
    /// A tenant's chat jobs waiting for their `notBefore` at once (more:
    /// refused with `queue_full`).
    pub max_delayed_jobs: u64,
}

impl Settings {
    /// The defaults for `subjects` and `profiles`.
    pub fn new(subjects: Subjects, profiles: FleetConfig) -> Self {
        Self {
            subjects,
            profiles: Arc::new(profiles),
            env: Arc::new(ProcessEnv),
            max_in_flight: 32,
            batch_max_wait: DEFAULT_BATCH_MAX_WAIT,
            chat_dispatch: ChatDispatch::Fair,
            default_timeout: Duration::from_secs(120),
            tool_wait_slack: Duration::from_secs(2),
            catalog_refresh: Duration::from_secs(2),
            catalog_wait: Duration::from_millis(250),
            compat: None,
            sinks: SinkSettings::default(),
            declared: DeclaredPools::none(),
            threads: crate::threads::store::ThreadSettings::default(),
            max_not_before: DEFAULT_MAX_NOT_BEFORE,
            max_delayed_jobs: DEFAULT_MAX_DELAYED_JOBS,
        }
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("subjects", &self.subjects)
            .field(
                "profiles",
                &self.profiles.profiles.keys().collect::<Vec<_>>(),
            )
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}
