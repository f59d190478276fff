//! Scheduled chat jobs: what the operator's `toolfleet schedule` writes and
//! every orchestrator reads, in the `<P>_SCHEDULES` key-value bucket (key
//! `<tenant>.<schedule id>`, [`schedule_key`]; value: a [`Schedule`] as
//! JSON), and the per-run budget a job may carry ([`RunBudget`]).
//!
//! A schedule fires once per due time across all orchestrators: the one
//! whose compare-and-set of the record (advancing [`Schedule::next_due`])
//! succeeds submits the run, as invocation [`Schedule::run_id`] — the due
//! time and a random nonce the winner chose and stored in the record, so
//! nobody can guess a future run's id (a tenant could otherwise take it
//! first, or cancel it in advance). The timing itself (cron in a time
//! zone) is the orchestrator's (`schedules`), so this crate takes no cron
//! or time-zone dependency.

use std::time::Duration;

use async_nats::jetstream;
use serde::{Deserialize, Serialize};

use crate::streams::{StreamError, key_value};
use crate::{ChatJob, Subjects};

impl Subjects {
    /// The key-value bucket of scheduled chat jobs (key:
    /// [`schedule_key`]): written by the operator (`toolfleet schedule`)
    /// and by the orchestrators as they fire, read by the orchestrators.
    pub fn schedules_bucket(&self) -> String {
        let chat = self.chat_stream();
        let stem = chat.strip_suffix("_CHAT").unwrap_or(&chat);
        format!("{stem}_SCHEDULES")
    }
}

/// The schedules bucket's key of `tenant`'s schedule `id`:
/// `<tenant>.<id>`. Both are 1-64 `[A-Za-z0-9_-]`, so the key is a valid
/// key-value key whose first token is the tenant.
#[must_use]
pub fn schedule_key(tenant: &str, id: &str) -> String {
    format!("{tenant}.{id}")
}

/// The tenant and schedule id of a schedules-bucket key, when it is one.
#[must_use]
pub fn parse_schedule_key(key: &str) -> Option<(&str, &str)> {
    let (tenant, id) = key.split_once('.')?;
    (crate::valid_tenant(tenant) && valid_schedule_id(id)).then_some((tenant, id))
}

/// Is `id` usable as a schedule id (1-64 `[A-Za-z0-9_-]`: one key token,
/// and part of its runs' invocation ids)?
#[must_use]
pub fn valid_schedule_id(id: &str) -> bool {
    crate::valid_tenant(id)
}

/// The schedules bucket, created on first use (the key-value layout by
/// hand, so nats-server 2.9 serves it); entries never expire.
///
/// # Errors
///
/// [`StreamError`] when the bucket cannot be made or read.
pub async fn schedules_bucket(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<jetstream::kv::Store, StreamError> {
    key_value(
        js,
        &subjects.schedules_bucket(),
        "toolfleet: scheduled chat jobs",
        Duration::ZERO,
        false,
    )
    .await
}

/// What happens to due times that passed while no orchestrator could fire
/// them (the fleet was down, or the schedule was paused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissedPolicy {
    /// They are dropped: the schedule waits for its next due time.
    #[default]
    Skip,
    /// One run is submitted for all of them, then the schedule waits for
    /// its next due time.
    CatchUpOne,
}

impl MissedPolicy {
    /// The value's name on the wire and on the command line.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            MissedPolicy::Skip => "skip",
            MissedPolicy::CatchUpOne => "catch_up_one",
        }
    }
}

/// A per-run budget a chat job asks for (`budget` in
/// `schemas/chat_job.schema.json`; a schedule's runs carry the schedule's).
/// It only tightens: the tenant's own per-run caps from the operator's
/// configuration (`max_run_tokens`, `max_run_spend_usd`) still apply, and
/// the smaller cap wins. A run past it ends with `run_limit_exceeded`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunBudget {
    /// Tokens the run's model calls may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// USD the run's model calls may cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_spend_usd: Option<f64>,
}

impl RunBudget {
    /// The tighter of `self` and `other`, cap by cap.
    #[must_use]
    pub fn tighter(self, other: Option<RunBudget>) -> RunBudget {
        let Some(other) = other else { return self };
        let min_u = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let min_f = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        RunBudget {
            max_tokens: min_u(self.max_tokens, other.max_tokens),
            max_spend_usd: min_f(self.max_spend_usd, other.max_spend_usd),
        }
    }

    /// Is every cap, when set, positive (and the spend finite)?
    #[must_use]
    pub fn is_valid(&self) -> bool {
        self.max_tokens.is_none_or(|t| t > 0)
            && self.max_spend_usd.is_none_or(|s| s.is_finite() && s > 0.0)
    }
}

/// One run a schedule submitted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScheduledRun {
    /// The run's invocation id ([`Schedule::run_id`]).
    pub invocation_id: String,
    /// The due time it was submitted for (unix seconds).
    pub due: i64,
    /// When it was recorded, just before its submission (unix ms).
    pub submitted_ms: u64,
    /// When the chat stream acknowledged its job (unix ms): absent, the
    /// run may never have been submitted (the orchestrator that won it
    /// died, or its publish failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_ms: Option<u64>,
}

impl ScheduledRun {
    /// A run of `schedule` for `due`, recorded at `now_ms`, under a fresh
    /// unguessable invocation id ([`Schedule::run_id`]).
    #[must_use]
    pub fn new(schedule: &Schedule, due: i64, now_ms: u64) -> Self {
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        Self {
            invocation_id: schedule.run_id(due, &nonce),
            due,
            submitted_ms: now_ms,
            accepted_ms: None,
        }
    }
}

/// A scheduled chat job: the record in the schedules bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Schedule {
    /// The tenant its runs run as (the key's first token).
    pub tenant: String,
    /// Its id within the tenant (the key's second token).
    pub id: String,
    /// The cron expression: 5 fields (minute to weekday) or 6 (seconds
    /// first).
    pub cron: String,
    /// The IANA time zone the expression is read in (`Europe/Paris`).
    pub tz: String,
    /// The job each run submits (its invocation id is the run's).
    pub job: ChatJob,
    /// Due times that passed unfired: skipped, or one run for them all.
    #[serde(default)]
    pub missed: MissedPolicy,
    /// Runs of this schedule that may be in flight at once (0: no limit).
    /// A due time that finds this many still running is skipped.
    #[serde(default = "one")]
    pub max_concurrent: u32,
    /// The budget each run carries (tightening the tenant's per-run caps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<RunBudget>,
    /// A paused schedule fires nothing; its due times pass as missed ones
    /// (so `resume` follows [`Schedule::missed`]).
    #[serde(default)]
    pub paused: bool,
    /// The next due time (unix seconds).
    pub next_due: i64,
    /// The runs that may still be in flight, newest last (the firing
    /// orchestrator drops those that ended; a schedule without a
    /// concurrency limit keeps its latest [`RUNS_KEPT_UNLIMITED`]): whether
    /// they ended tells whether the schedule is busy.
    #[serde(default)]
    pub runs: Vec<ScheduledRun>,
    /// When the schedule was added (unix ms).
    #[serde(default)]
    pub created_ms: u64,
}

fn one() -> u32 {
    1
}

/// Runs remembered by a schedule without a concurrency limit.
pub const RUNS_KEPT_UNLIMITED: usize = 16;

impl Schedule {
    /// The invocation id of its run for due time `due` (unix seconds):
    /// `sched-<id>-<due>-<nonce>`, the nonce chosen at random by the
    /// orchestrator that won the due time and kept in the record (at most
    /// 114 characters: the id is at most 64).
    #[must_use]
    pub fn run_id(&self, due: i64, nonce: &str) -> String {
        format!("sched-{}-{due}-{nonce}", self.id)
    }

    /// The key of this schedule in the bucket.
    #[must_use]
    pub fn key(&self) -> String {
        schedule_key(&self.tenant, &self.id)
    }

    /// The job of `run`: the template with the run's invocation id, the
    /// schedule's tenant and its budget (the tighter of the schedule's and
    /// the template's own).
    #[must_use]
    pub fn job_for(&self, run: &ScheduledRun) -> ChatJob {
        let mut job = self.job.clone();
        job.invocation_id = run.invocation_id.clone();
        job.tenant = Some(self.tenant.clone());
        if let Some(budget) = self.budget {
            job.budget = Some(budget.tighter(job.budget));
        }
        job
    }

    /// Remembers `run`. A schedule without a concurrency limit forgets
    /// its oldest past [`RUNS_KEPT_UNLIMITED`]; one with a limit forgets
    /// nothing here (a run still in flight must be counted: the firing
    /// orchestrator drops the runs that ended before it remembers a new
    /// one, so they stay within the limit).
    pub fn remember(&mut self, run: ScheduledRun) {
        self.runs.push(run);
        if self.max_concurrent == 0 && self.runs.len() > RUNS_KEPT_UNLIMITED {
            let extra = self.runs.len() - RUNS_KEPT_UNLIMITED;
            self.runs.drain(..extra);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> Schedule {
        Schedule {
            tenant: "acme".into(),
            id: "daily".into(),
            cron: "0 9 * * 1-5".into(),
            tz: "Europe/Paris".into(),
            job: serde_json::from_value(serde_json::json!({
                "invocationId": "template",
                "messages": [{"role": "user", "content": "report"}],
                "budget": {"maxTokens": 5000}
            }))
            .unwrap(),
            missed: MissedPolicy::Skip,
            max_concurrent: 1,
            budget: Some(RunBudget {
                max_tokens: Some(10_000),
                max_spend_usd: Some(0.5),
            }),
            paused: false,
            next_due: 1_800_000_000,
            runs: Vec::new(),
            created_ms: 0,
        }
    }

    #[test]
    fn a_run_has_the_runs_id_tenant_and_the_tighter_budget() {
        let s = schedule();
        let run = ScheduledRun::new(&s, 1_800_000_000, 0);
        let job = s.job_for(&run);
        assert_eq!(job.invocation_id, run.invocation_id);
        assert!(
            job.invocation_id.starts_with("sched-daily-1800000000-"),
            "{}",
            job.invocation_id
        );
        // The nonce: another run of the same due time has another id.
        assert_ne!(
            ScheduledRun::new(&s, 1_800_000_000, 0).invocation_id,
            run.invocation_id
        );
        assert!(crate::valid_invocation_id(&job.invocation_id));
        let mut longest = s.clone();
        longest.id = "x".repeat(64);
        let id = ScheduledRun::new(&longest, i64::from(i32::MAX) * 4, 0).invocation_id;
        assert!(crate::valid_invocation_id(&id), "{id}");
        assert_eq!(job.tenant.as_deref(), Some("acme"));
        assert_eq!(
            job.budget,
            Some(RunBudget {
                max_tokens: Some(5000),
                max_spend_usd: Some(0.5)
            })
        );
    }

    #[test]
    fn keys_round_trip_and_bad_ones_are_refused() {
        assert_eq!(schedule().key(), "acme.daily");
        assert_eq!(parse_schedule_key("acme.daily"), Some(("acme", "daily")));
        assert_eq!(parse_schedule_key("acme"), None);
        assert_eq!(parse_schedule_key("acme.a.b"), None);
        assert!(!valid_schedule_id("a b"));
        assert!(!valid_schedule_id(""));
    }

    #[test]
    fn the_record_round_trips_and_keeps_its_runs() {
        let mut s = schedule();
        s.max_concurrent = 2;
        for due in 0..3 {
            let run = ScheduledRun::new(&s, due, 0);
            s.remember(run);
        }
        // A limit forgets no run here: the firing orchestrator drops the
        // ended ones.
        assert_eq!(s.runs.len(), 3);
        let mut unlimited = s.clone();
        unlimited.max_concurrent = 0;
        for due in 3..40 {
            let run = ScheduledRun::new(&unlimited, due, 0);
            unlimited.remember(run);
        }
        assert_eq!(unlimited.runs.len(), RUNS_KEPT_UNLIMITED);
        assert_eq!(unlimited.runs.last().unwrap().due, 39);
        s.runs[0].accepted_ms = Some(5);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
        assert_eq!(
            Subjects::new("acme.tf").unwrap().schedules_bucket(),
            "ACME_TF_SCHEDULES"
        );
    }

    #[test]
    fn a_budget_must_be_positive() {
        assert!(RunBudget::default().is_valid());
        assert!(
            !RunBudget {
                max_tokens: Some(0),
                max_spend_usd: None
            }
            .is_valid()
        );
        assert!(
            !RunBudget {
                max_tokens: None,
                max_spend_usd: Some(f64::NAN)
            }
            .is_valid()
        );
    }
}
