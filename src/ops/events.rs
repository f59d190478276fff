//! `toolfleet events`: an invocation's events, replayed from the history
//! stream (two hours) and, while it runs, followed to its end; or, with
//! `--thread`, the events of every invocation of a thread.

use std::time::Duration;

use async_nats::jetstream;
use clap::Args;
use futures::StreamExt;
use toolfleet_protocol::{ChatEvent, ChatEventBody, Subjects};
use toolfleet_service::args::NatsArgs;

use crate::common::{Output, one_line};

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// The invocation id (or `--thread`).
    #[arg(required_unless_present = "thread")]
    invocation_id: Option<String>,
    /// Follow a thread instead of one invocation: the events of every
    /// invocation of the tenant's thread (those whose `thread` or
    /// `started` event names it), from what the history keeps on.
    #[arg(long, conflicts_with = "invocation_id")]
    thread: Option<String>,
    /// The invocation's tenant.
    #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
    tenant: String,
    /// Stop at the events stored so far instead of following a running
    /// invocation.
    #[arg(long)]
    no_follow: bool,
    /// `text` (a line per event) or `json` (JSON lines).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(flatten)]
    nats: NatsArgs,
}

/// `toolfleet events`: the events of the invocation as the history stream
/// keeps them (two hours; every event but the deltas — the answer's text
/// is in `completed`), in order; without `--no-follow`, a running
/// invocation's next ones until its terminal event. Exits 0 once a
/// terminal event was shown (1 when it was an error), 1 when the stream
/// holds nothing of the invocation (unknown, still queued or expired), 2
/// when it is still running and `--no-follow` was given.
pub async fn run(args: EventsArgs) -> anyhow::Result<i32> {
    if let Some(thread) = &args.thread {
        return thread_events(&args, thread).await;
    }
    let EventsArgs {
        invocation_id,
        tenant,
        no_follow,
        output,
        nats,
        ..
    } = &args;
    let invocation_id = invocation_id.as_deref().unwrap_or_default();
    let (tenant, follow) = (tenant.as_str(), !no_follow);
    if !crate::common::tenant_ok("toolfleet events", tenant)
        || !crate::common::invocation_ok("toolfleet events", invocation_id)
    {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects: Subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-events").await?;
    let js = jetstream::new(client);
    let stream = js
        .get_stream(subjects.history_stream())
        .await
        .map_err(|e| anyhow::anyhow!("the history stream {}: {e}", subjects.history_stream()))?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: subjects.chat_history(tenant, invocation_id),
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut pending = consumer.cached_info().num_pending;
    if pending == 0 {
        eprintln!(
            "no events of {invocation_id} (tenant {tenant}): unknown, still queued, or older \
             than the history keeps ({} h)",
            toolfleet_protocol::streams::HISTORY_MAX_AGE.as_secs() / 3600
        );
        return Ok(1);
    }
    let mut messages = consumer.messages().await?;
    let mut printer = EventPrinter::new(*output);
    loop {
        if pending == 0 && !follow {
            eprintln!(
                "{invocation_id} is still running (without --no-follow it is followed to its end)"
            );
            return Ok(2);
        }
        // An invocation runs an hour at most.
        let msg = match tokio::time::timeout(Duration::from_secs(3600), messages.next()).await {
            Ok(Some(Ok(msg))) => msg,
            Ok(Some(Err(e))) => return Err(anyhow::anyhow!("reading the events stream: {e}")),
            Ok(None) | Err(_) => {
                eprintln!("no further events of {invocation_id}");
                return Ok(1);
            }
        };
        if let Ok(info) = msg.info() {
            pending = info.pending;
        }
        let published = msg
            .info()
            .map(|i| i.published)
            .unwrap_or_else(|_| time::OffsetDateTime::now_utc());
        let Ok(event) = toolfleet_protocol::Envelope::ChatEvent.decode::<ChatEvent>(&msg.payload)
        else {
            continue;
        };
        match printer.show(&event, published) {
            Some(code) => {
                return Ok(code);
            }
            None => continue,
        }
    }
}

/// `toolfleet events --thread T`: the tenant's history, every event of
/// the invocations of thread `T` shown as it comes (each begins with a
/// `thread` or `started` event naming it). Without `--no-follow` it goes
/// on with the thread's next jobs until interrupted (or an hour without
/// one); with it, exits 0 at the end of what is stored (1: nothing of
/// the thread).
async fn thread_events(args: &EventsArgs, thread: &str) -> anyhow::Result<i32> {
    let tenant = args.tenant.as_str();
    if !crate::common::tenant_ok("toolfleet events", tenant) {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if !toolfleet_protocol::thread::valid_thread_id(thread) {
        eprintln!("toolfleet events: --thread {thread:?} is not 1-128 of [A-Za-z0-9_-]");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects: Subjects = args.nats.subjects()?;
    let js = jetstream::new(args.nats.connect("toolfleet-events").await?);
    let stream = js
        .get_stream(subjects.history_stream())
        .await
        .map_err(|e| anyhow::anyhow!("the history stream {}: {e}", subjects.history_stream()))?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: subjects.chat_history_of(tenant),
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut pending = consumer.cached_info().num_pending;
    let mut messages = consumer.messages().await?;
    let mut printer = EventPrinter::new(args.output);
    let mut members = std::collections::HashSet::new();
    loop {
        if pending == 0 && args.no_follow {
            if members.is_empty() {
                eprintln!("no events of thread {thread} (tenant {tenant}) in the history");
                return Ok(1);
            }
            return Ok(0);
        }
        let msg = match tokio::time::timeout(Duration::from_secs(3600), messages.next()).await {
            Ok(Some(Ok(msg))) => msg,
            Ok(Some(Err(e))) => return Err(anyhow::anyhow!("reading the events stream: {e}")),
            Ok(None) | Err(_) => return Ok(0),
        };
        let Ok(info) = msg.info() else { continue };
        pending = info.pending;
        let Ok(event) = toolfleet_protocol::Envelope::ChatEvent.decode::<ChatEvent>(&msg.payload)
        else {
            continue;
        };
        let names = match &event.body {
            ChatEventBody::Thread { thread_id, .. } => Some(thread_id.as_str()),
            ChatEventBody::Started { thread_id, .. } => thread_id.as_deref(),
            ChatEventBody::Duplicate { thread_id, .. } => thread_id.as_deref(),
            _ => None,
        };
        if names == Some(thread)
            && members.insert(event.invocation_id.clone())
            && args.output == Output::Text
        {
            println!("-- {} (thread {thread})", event.invocation_id);
        }
        if members.contains(&event.invocation_id) {
            printer.show(&event, info.published);
        }
    }
}

/// Prints events: JSON lines, or a line per event.
struct EventPrinter {
    output: Output,
}

impl EventPrinter {
    fn new(output: Output) -> Self {
        Self { output }
    }

    /// Prints `event`; the exit code once it is terminal.
    fn show(&mut self, event: &ChatEvent, at: time::OffsetDateTime) -> Option<i32> {
        let terminal = match &event.body {
            ChatEventBody::Completed { .. } => Some(0),
            ChatEventBody::Error { .. } => Some(1),
            _ => None,
        };
        if self.output == Output::Json {
            let mut v = serde_json::to_value(event).unwrap_or_default();
            v["published"] = at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
                .into();
            println!("{v}");
            return terminal;
        }
        let clock = format!(
            "{:02}:{:02}:{:02}.{:03}",
            at.hour(),
            at.minute(),
            at.second(),
            at.millisecond()
        );
        let mut v = serde_json::to_value(&event.body).unwrap_or_default();
        let kind = v["type"].as_str().unwrap_or("?").to_string();
        let detail = match &event.body {
            // The answer first, then what it cost.
            ChatEventBody::Completed {
                text,
                references,
                usage,
                ..
            } => format!(
                "{} ({} reference(s), {} tokens)",
                one_line(text, 160),
                references.len(),
                usage.total_tokens
            ),
            ChatEventBody::Error { code, message, .. } => {
                format!("{code}: {}", one_line(message, 160))
            }
            _ => {
                if let Some(o) = v.as_object_mut() {
                    o.remove("type");
                }
                one_line(&v.to_string(), 160)
            }
        };
        println!("{clock} {:>4} {kind:<14} {detail}", event.seq);
        terminal
    }
}
