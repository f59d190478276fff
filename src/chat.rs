//! `toolfleet chat`: submit a chat job, show its progress on stderr and
//! print the answer with its references. [`ask`] and [`Progress`] serve
//! `toolfleet demo` too.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use tracing::Instrument;

use toolfleet_protocol::{ChatEvent, ChatEventBody};
use toolfleet_service::args::NatsArgs;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The question; read from standard input when absent or `-`.
    pub question: Option<String>,
    /// The profile to answer with (the orchestrator's default when absent).
    #[arg(id = "job_profile", long = "profile", env = "TOOLFLEET_CHAT_PROFILE")]
    pub profile: Option<String>,
    /// The user the job is asked for (scopes user-owned context).
    #[arg(id = "job_user", long = "user", env = "TOOLFLEET_CHAT_USER")]
    pub user: Option<String>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Print every event as a JSON line instead of the rendered answer.
    #[arg(long)]
    pub json: bool,
    /// The tenant to ask as (1-64 of [A-Za-z0-9_-]): the submit, events
    /// and cancel subjects name it.
    #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
    pub tenant: String,
    /// Submit as a batch job: taken after interactive jobs, with the
    /// deployment's batch service tier.
    #[arg(long)]
    pub batch: bool,
    /// The thread the question continues (1-128 of [A-Za-z0-9_-]): the
    /// fleet keeps its earlier turns (docs/threads.md).
    #[arg(long)]
    pub thread: Option<String>,
    /// When the thread has a job running: reject, enqueue, interrupt or
    /// rollback (else the profile's, else reject).
    #[arg(long, requires = "thread")]
    pub strategy: Option<toolfleet_protocol::thread::MultitaskStrategy>,
    /// A key that makes a repeat of this question (within the fleet's
    /// window, 24 h) get the first one's answer instead of running again.
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

/// What `toolfleet chat` shows on stderr while it waits: the tool calls as
/// they happen and, on a terminal, one progress line (rewritten in place)
/// with the time waited. The answer itself is printed once, on stdout,
/// when it is complete (its markers renumbered to the references listed).
pub(crate) struct Progress {
    terminal: bool,
    started: std::time::Instant,
    tools: u32,
    /// A progress line is on screen (to clear before anything else).
    shown: bool,
}

impl Progress {
    pub(crate) fn new() -> Self {
        use std::io::IsTerminal;
        Self {
            terminal: std::io::stderr().is_terminal(),
            started: std::time::Instant::now(),
            tools: 0,
            shown: false,
        }
    }

    pub(crate) fn clear(&mut self) {
        if self.shown {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
            self.shown = false;
        }
    }

    pub(crate) fn tick(&mut self) {
        if !self.terminal {
            return;
        }
        let tools = match self.tools {
            0 => String::new(),
            1 => ", 1 tool call".to_owned(),
            n => format!(", {n} tool calls"),
        };
        eprint!(
            "\r\x1b[2K… waiting for the answer ({:.0} s{tools})",
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stderr().flush();
        self.shown = true;
    }

    pub(crate) fn event(&mut self, event: &ChatEvent) {
        match &event.body {
            ChatEventBody::ToolCall {
                tool, arguments, ..
            } => {
                self.clear();
                self.tools += 1;
                eprintln!("  → {tool} {arguments}");
            }
            ChatEventBody::ToolResult {
                tool,
                status,
                duration_ms,
                error_code,
                cached,
                ..
            } => {
                self.clear();
                let code = error_code
                    .as_deref()
                    .map(|c| format!(" ({c})"))
                    .unwrap_or_default();
                let cached = if *cached { ", cached" } else { "" };
                eprintln!(
                    "  ← {tool}: {}{code} in {duration_ms} ms{cached}",
                    status.as_str()
                );
            }
            ChatEventBody::ApprovalRequested {
                call_id,
                tool,
                arguments,
                ..
            } => {
                self.clear();
                eprintln!(
                    "  ⏸ {tool} {arguments} waits for approval:\n      toolfleet approve {} {call_id}   (or --deny REASON)",
                    event.invocation_id
                );
            }
            ChatEventBody::ApprovalResolved { tool, decision, .. } => {
                self.clear();
                eprintln!("  ▶ {tool}: {}", decision.as_str());
            }
            _ => {}
        }
        self.tick();
    }
}

/// Asks `job`, showing progress; Ctrl-C publishes the invocation's cancel
/// and waits (up to 5 s) for its `error: cancelled` before giving up.
pub(crate) async fn ask(
    client: &async_nats::Client,
    subjects: &toolfleet_protocol::Subjects,
    job: &toolfleet_protocol::ChatJob,
    timeout: Duration,
    mut on_event: impl FnMut(&ChatEvent),
) -> Result<toolfleet_protocol::client::ChatOutcome, AskError> {
    let answer = toolfleet_protocol::client::chat(client, subjects, job, timeout, |e| on_event(e));
    tokio::pin!(answer);
    tokio::select! {
        result = &mut answer => result.map_err(AskError::Failed),
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\ncancelling {} …", job.invocation_id);
            let tenant = job.tenant.as_deref().unwrap_or(toolfleet_protocol::DEFAULT_TENANT);
            let _ = client
                .publish(subjects.chat_cancel(tenant, &job.invocation_id), "".into())
                .await;
            let _ = client.flush().await;
            match tokio::time::timeout(Duration::from_secs(5), &mut answer).await {
                Ok(Err(e)) if e.to_string().contains("cancelled") => Err(AskError::Cancelled(true)),
                Ok(Ok(outcome)) => Ok(outcome),
                _ => Err(AskError::Cancelled(false)),
            }
        }
    }
}

/// The answer as printed: its text, then its numbered references with
/// their links.
pub(crate) fn rendered(outcome: &toolfleet_protocol::client::ChatOutcome) -> String {
    toolfleet_protocol::references::render(&outcome.text, &outcome.references).to_markdown()
}

/// How [`ask`] ended without an answer.
pub(crate) enum AskError {
    Failed(toolfleet_protocol::client::ClientError),
    /// Interrupted; whether the fleet confirmed the cancel.
    Cancelled(bool),
}

/// Exit code of an interrupted command (128 + SIGINT).
pub(crate) const EXIT_INTERRUPTED: i32 = 130;

/// `toolfleet chat`: exit 0 with an answer, 1 on an error, 64 for a bad
/// tenant or an empty question, 130 when interrupted.
pub async fn run(args: ChatArgs) -> anyhow::Result<i32> {
    if !crate::common::tenant_ok("toolfleet chat", &args.tenant) {
        return Ok(64);
    }
    let question = read_question(args.question.as_deref())?;
    if question.trim().is_empty() {
        eprintln!("toolfleet chat: the question is empty (give it as an argument or on stdin)");
        return Ok(64);
    }
    let subjects = args.nats.subjects()?;
    let client = args.nats.connect("toolfleet-chat").await?;
    let timeout = Duration::from_secs(args.timeout);
    let mut job = toolfleet_protocol::client::question(question.trim_end());
    job.tenant = Some(args.tenant.clone());
    job.profile = args.profile.clone();
    job.user = args.user.clone();
    job.priority = args.batch.then_some(toolfleet_protocol::Priority::Batch);
    for (flag, value) in [
        ("--thread", &args.thread),
        ("--idempotency-key", &args.idempotency_key),
    ] {
        if let Some(value) = value
            && !toolfleet_protocol::thread::valid_thread_id(value)
        {
            eprintln!("toolfleet chat: {flag} {value:?} is not 1-128 of [A-Za-z0-9_-]");
            return Ok(64);
        }
    }
    job.thread_id = args.thread.clone();
    job.multitask_strategy = args.strategy;
    job.idempotency_key = args.idempotency_key.clone();
    // The trace starts here: the orchestrator's and the workers' spans are
    // its children (exported when an OTLP endpoint is configured).
    let span = tracing::info_span!(
        "chat",
        otel.name = "chat toolfleet",
        otel.kind = "producer",
        invocation_id = %job.invocation_id,
    );
    job.traceparent = Some(
        toolfleet_service::telemetry::traceparent(&span, None)
            .unwrap_or_else(toolfleet_service::telemetry::new_traceparent),
    );
    if args.json {
        let result = ask(&client, &subjects, &job, timeout, |e| {
            println!("{}", serde_json::to_string(e).unwrap_or_default());
        })
        .instrument(span)
        .await;
        return Ok(match result {
            Ok(_) => 0,
            Err(AskError::Failed(e)) => {
                eprintln!("error: {e}");
                1
            }
            Err(AskError::Cancelled(_)) => EXIT_INTERRUPTED,
        });
    }
    let mut progress = Progress::new();
    progress.tick();
    let result = ask(&client, &subjects, &job, timeout, |e| progress.event(e))
        .instrument(span)
        .await;
    progress.clear();
    Ok(print_outcome(result))
}

/// The question as given, or standard input when absent or `-`.
fn read_question(given: Option<&str>) -> anyhow::Result<String> {
    Ok(match given {
        Some(q) if q != "-" => q.to_owned(),
        _ => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
            text
        }
    })
}

/// Prints how [`ask`] ended (the answer on stdout, the rest on stderr);
/// the exit code.
fn print_outcome(result: Result<toolfleet_protocol::client::ChatOutcome, AskError>) -> i32 {
    match result {
        Ok(outcome) => {
            println!("{}", rendered(&outcome));
            0
        }
        Err(AskError::Failed(e)) => {
            eprintln!("error: {e:#}");
            1
        }
        Err(AskError::Cancelled(confirmed)) => {
            eprintln!(
                "{}",
                if confirmed {
                    "cancelled"
                } else {
                    "cancel sent; the fleet did not confirm it in time"
                }
            );
            EXIT_INTERRUPTED
        }
    }
}
