//! `toolfleet schedule add|ls|rm|pause|resume`: the operator's scheduled
//! chat jobs, kept in the schedules bucket (`<P>_SCHEDULES`, key
//! `<tenant>.<id>`), which every orchestrator watches and fires once per
//! due time across the fleet (docs/schedules.md).
//!
//! `add` checks everything before it stores anything: the tenant and id,
//! the cron expression and time zone (with the orchestrator's own parser,
//! so what is accepted here fires there), the job file against the chat
//! job schema (its `invocationId` may be left out: each run gets its own),
//! its tenant, and the budget. A refusal exits 64 and stores nothing.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::Value;
use toolfleet_orchestrator::schedules::Timing;
use toolfleet_protocol::schedule::{
    MissedPolicy, RunBudget, Schedule, parse_schedule_key, schedule_key, schedules_bucket,
    valid_schedule_id,
};
use toolfleet_protocol::{ChatJob, Envelope};
use toolfleet_service::args::{EXIT_CONFIG, NatsArgs};

#[derive(Subcommand, Debug)]
pub enum ScheduleCommand {
    /// Add a schedule: its job is submitted as the tenant at every due
    /// time of the cron expression (in --tz), once across all
    /// orchestrators. Prints the schedule; exit 64 when refused (bad cron,
    /// time zone, job or budget; an id already taken without --replace).
    Add(Box<AddArgs>),
    /// List schedules (every tenant's, or --tenant's): one a line.
    Ls(LsArgs),
    /// Remove a schedule (runs already submitted go on).
    Rm(KeyArgs),
    /// Pause a schedule: it fires nothing until resumed.
    Pause(KeyArgs),
    /// Resume a paused schedule; due times passed meanwhile are missed
    /// ones (its --missed policy).
    Resume(KeyArgs),
}

/// What happens to due times that passed unfired.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Missed {
    /// Drop them; wait for the next due time.
    Skip,
    /// Submit one run for them all.
    CatchUpOne,
}

/// A schedule's tenant and id.
#[derive(Args, Debug)]
pub struct KeyArgs {
    /// The tenant the schedule's runs run as.
    #[arg(long)]
    tenant: String,
    /// The schedule's id (1-64 of [A-Za-z0-9_-]).
    #[arg(long)]
    id: String,
    #[command(flatten)]
    nats: NatsArgs,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// The tenant the runs run as (they are submitted on its subject; its
    /// profiles, trust and limits apply).
    #[arg(long)]
    tenant: String,
    /// The schedule's id (default: a new one, printed).
    #[arg(long)]
    id: Option<String>,
    /// Cron expression: 5 fields (minute hour day-of-month month
    /// day-of-week) or 6 (seconds first), e.g. "0 9 * * 1-5"; a 7th
    /// (year) is refused.
    #[arg(long)]
    cron: String,
    /// IANA time zone the expression is read in.
    #[arg(long, default_value = "UTC")]
    tz: String,
    /// The chat job each run submits (JSON; `invocationId` may be left
    /// out).
    #[arg(long, value_name = "FILE")]
    job: PathBuf,
    /// Due times that passed while the fleet was down (or the schedule
    /// paused): skipped, or one run for them all.
    #[arg(long, value_enum, default_value_t = Missed::Skip)]
    missed: Missed,
    /// Runs of this schedule in flight at once; a due time that finds
    /// this many still running is skipped.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrent: u32,
    /// No limit on runs in flight at once (over --max-concurrent).
    #[arg(long)]
    allow_concurrent: bool,
    /// Each run's token budget (the tenant's max_run_tokens still
    /// applies: the smaller wins).
    #[arg(long)]
    max_tokens: Option<u64>,
    /// Each run's spend budget in USD (the tenant's max_run_spend_usd
    /// still applies: the smaller wins).
    #[arg(long)]
    max_spend_usd: Option<f64>,
    /// Replace a schedule of the same id (keeping the runs it recorded:
    /// still in flight, they count against its limit).
    #[arg(long)]
    replace: bool,
    #[command(flatten)]
    nats: NatsArgs,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only this tenant's schedules.
    #[arg(long)]
    tenant: Option<String>,
    /// One JSON record a line instead of columns.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    nats: NatsArgs,
}

/// `toolfleet schedule …`; the exit code.
pub async fn run(command: ScheduleCommand) -> anyhow::Result<i32> {
    match command {
        ScheduleCommand::Add(args) => add(*args).await,
        ScheduleCommand::Ls(args) => ls(args).await,
        ScheduleCommand::Rm(args) => rm(args).await,
        ScheduleCommand::Pause(args) => set_paused(args, true).await,
        ScheduleCommand::Resume(args) => set_paused(args, false).await,
    }
}

async fn bucket(nats: &NatsArgs) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-schedule").await?;
    let js = async_nats::jetstream::new(client);
    schedules_bucket(&js, &subjects)
        .await
        .context("opening the schedules bucket")
}

/// The current unix time, in seconds.
fn now_secs() -> i64 {
    i64::try_from(toolfleet_protocol::now_ms() / 1000).unwrap_or(i64::MAX)
}

/// The schedule `add` would store, or why not.
fn build(args: &AddArgs, now: i64) -> Result<Schedule, String> {
    if !toolfleet_protocol::valid_tenant(&args.tenant) {
        return Err(format!(
            "--tenant {:?} is not 1-64 of [A-Za-z0-9_-]",
            args.tenant
        ));
    }
    let id = args.id.clone().unwrap_or_else(|| {
        format!(
            "s-{}",
            &toolfleet_protocol::client::new_invocation_id()[4..16]
        )
    });
    if !valid_schedule_id(&id) {
        return Err(format!("--id {id:?} is not 1-64 of [A-Za-z0-9_-]"));
    }
    let timing = Timing::parse(&args.cron, &args.tz).map_err(|e| e.to_string())?;
    let next_due = timing.next_after(now).map_err(|e| e.to_string())?;
    let job = job_of(&args.job, &args.tenant)?;
    let budget = RunBudget {
        max_tokens: args.max_tokens,
        max_spend_usd: args.max_spend_usd,
    };
    if !budget.is_valid() {
        return Err("--max-tokens and --max-spend-usd must be positive".into());
    }
    Ok(Schedule {
        tenant: args.tenant.clone(),
        id,
        cron: args.cron.trim().to_string(),
        tz: args.tz.trim().to_string(),
        job,
        missed: match args.missed {
            Missed::Skip => MissedPolicy::Skip,
            Missed::CatchUpOne => MissedPolicy::CatchUpOne,
        },
        max_concurrent: if args.allow_concurrent {
            0
        } else {
            args.max_concurrent
        },
        budget: (budget != RunBudget::default()).then_some(budget),
        paused: false,
        next_due,
        runs: Vec::new(),
        created_ms: toolfleet_protocol::now_ms(),
    })
}

/// The job in `path`, checked against the chat job schema (an absent
/// `invocationId` filled in: each run gets its own), for `tenant`.
fn job_of(path: &std::path::Path, tenant: &str) -> Result<ChatJob, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--job {}: {e}", path.display()))?;
    let mut value: Value = serde_json::from_str(&text)
        .map_err(|e| format!("--job {}: not JSON: {e}", path.display()))?;
    let Some(object) = value.as_object_mut() else {
        return Err(format!("--job {}: not a JSON object", path.display()));
    };
    object
        .entry("invocationId")
        .or_insert_with(|| Value::String("scheduled".into()));
    let bytes = serde_json::to_vec(&value).map_err(|e| e.to_string())?;
    let job: ChatJob = Envelope::ChatJob
        .decode(&bytes)
        .map_err(|e| format!("--job {}: {e}", path.display()))?;
    if let Some(named) = job.tenant.as_deref().filter(|t| *t != tenant) {
        return Err(format!(
            "--job {} names tenant {named:?}, not --tenant {tenant:?}",
            path.display()
        ));
    }
    if job.idempotency_key.is_some() {
        return Err(format!(
            "--job {}: a scheduled job has no idempotencyKey (every run would repeat the first \
             one's answer instead of running)",
            path.display()
        ));
    }
    if job.not_before.is_some() {
        return Err(format!(
            "--job {}: a scheduled job has no notBefore (the schedule says when)",
            path.display()
        ));
    }
    Ok(job)
}

async fn add(args: AddArgs) -> anyhow::Result<i32> {
    const COMMAND: &str = "toolfleet schedule add";
    let schedule = match build(&args, now_secs()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{COMMAND}: {e}");
            return Ok(EXIT_CONFIG);
        }
    };
    let bucket = bucket(&args.nats).await?;
    let key = schedule.key();
    let value = serde_json::to_vec(&schedule)?;
    if args.replace {
        replace(&bucket, &key, schedule.clone()).await?;
    } else if let Err(e) = bucket.create(&key, value.into()).await {
        if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists {
            eprintln!(
                "{COMMAND}: tenant {} already has a schedule {} (--replace to replace it)",
                schedule.tenant, schedule.id
            );
            return Ok(EXIT_CONFIG);
        }
        return Err(anyhow::Error::new(e).context("storing the schedule"));
    }
    println!("{}", serde_json::to_string_pretty(&schedule)?);
    eprintln!(
        "schedule {} of tenant {}: next due {}",
        schedule.id,
        schedule.tenant,
        toolfleet_orchestrator::schedules::timing::utc(schedule.next_due)
    );
    Ok(0)
}

/// Stores `schedule` under `key` in place of the one there, keeping its
/// runs (still in flight, they count against the new record's limit): a
/// compare-and-set, tried again when an orchestrator fired it in between;
/// a plain create when there is none.
async fn replace(
    bucket: &async_nats::jetstream::kv::Store,
    key: &str,
    mut schedule: Schedule,
) -> anyhow::Result<()> {
    for _ in 0..10 {
        let current = bucket.entry(key).await.context("reading the schedule")?;
        let Some(entry) =
            current.filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put)
        else {
            let value = serde_json::to_vec(&schedule)?;
            if bucket.create(key, value.into()).await.is_ok() {
                return Ok(());
            }
            continue;
        };
        if let Ok(old) = serde_json::from_slice::<Schedule>(&entry.value) {
            schedule.runs = old.runs;
        }
        let value = serde_json::to_vec(&schedule)?;
        if bucket
            .update(key, value.into(), entry.revision)
            .await
            .is_ok()
        {
            return Ok(());
        }
    }
    anyhow::bail!("the schedule kept changing; try again")
}

async fn ls(args: LsArgs) -> anyhow::Result<i32> {
    use futures::TryStreamExt;
    if let Some(tenant) = &args.tenant
        && !crate::common::tenant_ok("toolfleet schedule ls", tenant)
    {
        return Ok(EXIT_CONFIG);
    }
    let bucket = bucket(&args.nats).await?;
    let mut keys: Vec<String> = bucket.keys().await?.try_collect().await?;
    keys.sort();
    for key in keys {
        let Some((tenant, _)) = parse_schedule_key(&key) else {
            continue;
        };
        if args.tenant.as_deref().is_some_and(|t| t != tenant) {
            continue;
        }
        let Some(bytes) = bucket.get(&key).await? else {
            continue;
        };
        let Ok(s) = serde_json::from_slice::<Schedule>(&bytes) else {
            println!("{key}\t(unreadable)");
            continue;
        };
        if args.json {
            println!("{}", serde_json::to_string(&s)?);
            continue;
        }
        println!(
            "{}\t{}\t{}\t{}\tnext {}\tmissed={}\tmax_concurrent={}\tlast={}",
            s.key(),
            s.cron,
            s.tz,
            if s.paused { "paused" } else { "active" },
            toolfleet_orchestrator::schedules::timing::utc(s.next_due),
            s.missed.as_str(),
            s.max_concurrent,
            s.runs.last().map_or("-", |r| r.invocation_id.as_str()),
        );
    }
    Ok(0)
}

/// The key of `args`, or the exit code after saying why not.
fn key_of(command: &str, args: &KeyArgs) -> Result<String, i32> {
    if !crate::common::tenant_ok(command, &args.tenant) {
        return Err(EXIT_CONFIG);
    }
    if !valid_schedule_id(&args.id) {
        eprintln!("{command}: --id {:?} is not 1-64 of [A-Za-z0-9_-]", args.id);
        return Err(EXIT_CONFIG);
    }
    Ok(schedule_key(&args.tenant, &args.id))
}

async fn rm(args: KeyArgs) -> anyhow::Result<i32> {
    const COMMAND: &str = "toolfleet schedule rm";
    let key = match key_of(COMMAND, &args) {
        Ok(key) => key,
        Err(code) => return Ok(code),
    };
    let bucket = bucket(&args.nats).await?;
    if bucket.get(&key).await?.is_none() {
        eprintln!(
            "{COMMAND}: no schedule {} of tenant {}",
            args.id, args.tenant
        );
        return Ok(1);
    }
    bucket.delete(&key).await.context("removing the schedule")?;
    eprintln!("schedule {} of tenant {} removed", args.id, args.tenant);
    Ok(0)
}

/// Pauses or resumes a schedule: a compare-and-set of its record, tried
/// again when an orchestrator fired it in between.
async fn set_paused(args: KeyArgs, paused: bool) -> anyhow::Result<i32> {
    let command = if paused {
        "toolfleet schedule pause"
    } else {
        "toolfleet schedule resume"
    };
    let key = match key_of(command, &args) {
        Ok(key) => key,
        Err(code) => return Ok(code),
    };
    let bucket = bucket(&args.nats).await?;
    for _ in 0..10 {
        let Some(entry) = bucket.entry(&key).await? else {
            eprintln!(
                "{command}: no schedule {} of tenant {}",
                args.id, args.tenant
            );
            return Ok(1);
        };
        if entry.operation != async_nats::jetstream::kv::Operation::Put {
            eprintln!(
                "{command}: no schedule {} of tenant {}",
                args.id, args.tenant
            );
            return Ok(1);
        }
        let mut s: Schedule =
            serde_json::from_slice(&entry.value).context("reading the schedule")?;
        s.paused = paused;
        let value = serde_json::to_vec(&s)?;
        if bucket
            .update(&key, value.into(), entry.revision)
            .await
            .is_ok()
        {
            eprintln!(
                "schedule {} of tenant {} {}",
                args.id,
                args.tenant,
                if paused { "paused" } else { "resumed" }
            );
            return Ok(0);
        }
    }
    anyhow::bail!("the schedule kept changing; try again")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: ScheduleCommand,
    }

    fn add_args(extra: &[&str], job: &std::path::Path) -> AddArgs {
        let mut argv = vec!["t", "add", "--tenant", "acme", "--job"];
        argv.push(job.to_str().unwrap());
        argv.extend_from_slice(extra);
        match Cli::parse_from(argv).command {
            ScheduleCommand::Add(a) => *a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn add_checks_cron_zone_job_and_budget_before_storing() {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("job.json");
        std::fs::write(
            &job,
            r#"{"messages": [{"role": "user", "content": "daily report"}]}"#,
        )
        .unwrap();
        let ok = build(
            &add_args(&["--cron", "0 9 * * 1-5", "--tz", "Europe/Paris"], &job),
            0,
        )
        .unwrap();
        assert_eq!(ok.tenant, "acme");
        assert!(ok.next_due > 0);
        assert_eq!(ok.max_concurrent, 1);
        let bad_cron = build(&add_args(&["--cron", "0 25 * * *"], &job), 0).unwrap_err();
        assert!(bad_cron.contains("cron expression"), "{bad_cron}");
        let bad_tz = build(
            &add_args(&["--cron", "0 9 * * *", "--tz", "Europe/Atlantis"], &job),
            0,
        )
        .unwrap_err();
        assert!(bad_tz.contains("IANA"), "{bad_tz}");
        let budget = build(
            &add_args(&["--cron", "0 9 * * *", "--max-spend-usd=-1"], &job),
            0,
        )
        .unwrap_err();
        assert!(budget.contains("positive"), "{budget}");
        std::fs::write(
            &job,
            r#"{"tenant": "globex", "messages": [{"role": "user", "content": "x"}]}"#,
        )
        .unwrap();
        let other = build(&add_args(&["--cron", "0 9 * * *"], &job), 0).unwrap_err();
        assert!(other.contains("globex"), "{other}");
        std::fs::write(
            &job,
            r#"{"idempotencyKey": "k1", "messages": [{"role": "user", "content": "x"}]}"#,
        )
        .unwrap();
        let keyed = build(&add_args(&["--cron", "0 9 * * *"], &job), 0).unwrap_err();
        assert!(keyed.contains("idempotencyKey"), "{keyed}");
        std::fs::write(&job, r#"{"messages": []}"#).unwrap();
        let empty = build(&add_args(&["--cron", "0 9 * * *"], &job), 0).unwrap_err();
        assert!(empty.contains("chat_job.schema.json"), "{empty}");
    }
}
