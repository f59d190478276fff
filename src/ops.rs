//! Operator commands that read the running fleet: `toolfleet status`
//! (pools, instances, tools served, backlog, last errors) and
//! `toolfleet events` (an invocation's events, replayed from the events
//! stream).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value, json};
use toolfleet_protocol::catalog::{META_TOOL_ID, META_WORKER};
use toolfleet_protocol::{ChatEvent, ChatEventBody, Subjects};
use toolfleet_service::args::NatsArgs;

use crate::cli::Output;

/// What `toolfleet status` gathered.
#[derive(Debug, Default)]
struct Status {
    /// One per worker instance that answered `$SRV.STATS`.
    instances: Vec<Value>,
    /// By tool id.
    tools: BTreeMap<String, Value>,
    dead_letters: Option<u64>,
    chat_backlog: Option<u64>,
}

/// `toolfleet status`: every worker instance (from `$SRV.INFO` and
/// `$SRV.STATS`), every tool (instances serving it, backlog and jobs in
/// flight from its consumer, jobs and errors from the instances' stats,
/// the newest error), the chat backlog and the dead letters kept. Exits 0;
/// [`EXIT_STRANDED`] when a tool has a backlog and no instance serves it.
pub async fn status(nats: &NatsArgs, wait: Duration, output: Output) -> anyhow::Result<i32> {
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-status").await?;
    let js = jetstream::new(client.clone());
    let service = subjects.worker_service();
    let infos =
        toolfleet_protocol::catalog::ask_all(&client, &format!("$SRV.INFO.{service}"), wait)
            .await?;
    let stats =
        toolfleet_protocol::catalog::ask_all(&client, &format!("$SRV.STATS.{service}"), wait)
            .await?;
    let mut status = Status::default();
    // Instances and the tools they serve come from INFO; STATS adds the
    // counts (an identity without STATS still sees who serves what).
    let mut known: BTreeMap<String, (usize, BTreeMap<String, String>)> = BTreeMap::new();
    for info in infos
        .iter()
        .filter_map(|m| serde_json::from_slice::<async_nats::service::Info>(m).ok())
        .filter(|i| {
            i.metadata.get(toolfleet_protocol::catalog::META_FLEET)
                == Some(&subjects.prefix().to_string())
        })
    {
        let tools: BTreeMap<String, String> = info
            .endpoints
            .iter()
            .filter_map(|e| Some((e.name.clone(), e.metadata.get(META_TOOL_ID)?.clone())))
            .collect();
        for tool in tools.values() {
            let row = status
                .tools
                .entry(tool.clone())
                .or_insert_with(|| tool_row(tool));
            row["instances"] = (row["instances"].as_u64().unwrap_or(0) + 1).into();
        }
        known.insert(info.id.clone(), (status.instances.len(), tools.clone()));
        status.instances.push(json!({
            "id": info.id,
            "worker": info.metadata.get(META_WORKER).cloned().unwrap_or_default(),
            "version": info.version,
            "started": null,
            "tools": tools.len(),
            "jobs": null,
            "errors": null,
        }));
    }
    let mut counted = 0;
    for stat in stats
        .iter()
        .filter_map(|m| serde_json::from_slice::<async_nats::service::Stats>(m).ok())
    {
        let Some((at, tools)) = known.get(&stat.id) else {
            continue;
        };
        counted += 1;
        let (mut jobs, mut errors) = (0, 0);
        for e in &stat.endpoints {
            let Some(tool) = tools.get(&e.name) else {
                continue;
            };
            let data = e.data.clone().unwrap_or(Value::Null);
            let n = |k: &str| data[k].as_u64().unwrap_or(0);
            jobs += n("jobs");
            errors += n("errors");
            let row = status
                .tools
                .entry(tool.clone())
                .or_insert_with(|| tool_row(tool));
            for k in ["jobs", "errors", "jetstream", "direct"] {
                row[k] = (row[k].as_u64().unwrap_or(0) + n(k)).into();
            }
            let newer = data["last_error"]["at_ms"].as_u64().unwrap_or(0)
                > row["last_error"]["at_ms"].as_u64().unwrap_or(0);
            if newer {
                row["last_error"] = data["last_error"].clone();
            }
        }
        let instance = &mut status.instances[*at];
        instance["started"] = stat.started.to_string().into();
        instance["jobs"] = jobs.into();
        instance["errors"] = errors.into();
    }
    if counted < known.len() {
        eprintln!(
            "{} of {} worker instance(s) did not answer $SRV.STATS within {} ms (busy, or no \
             permission): their job counts are missing",
            known.len() - counted,
            known.len(),
            wait.as_millis()
        );
    }
    // The pools' queues: the tools stream's consumers.
    if let Ok(mut stream) = js.get_stream(subjects.tools_stream()).await {
        let _ = stream.info().await;
        let mut consumers = stream.consumers();
        while let Some(Ok(info)) = consumers.next().await {
            let Some(tool) = subjects.tool_of_subject(&info.config.filter_subject) else {
                continue;
            };
            let row = status
                .tools
                .entry(tool.clone())
                .or_insert_with(|| tool_row(&tool));
            row["backlog"] = info.num_pending.into();
            row["in_flight"] = (info.num_ack_pending as u64).into();
        }
    }
    if let Ok(mut s) = js.get_stream(subjects.dead_letters_stream()).await
        && let Ok(info) = s.info().await
    {
        status.dead_letters = Some(info.state.messages);
    }
    if let Ok(s) = js.get_stream(subjects.chat_stream()).await
        && let Ok(c) = s
            .get_consumer::<jetstream::consumer::pull::Config>(&subjects.chat_consumer())
            .await
    {
        status.chat_backlog = Some(c.cached_info().num_pending);
    }
    let stranded: Vec<&String> = status
        .tools
        .iter()
        .filter(|(_, r)| r["instances"] == 0 && r["backlog"].as_u64().unwrap_or(0) > 0)
        .map(|(id, _)| id)
        .collect();
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "instances": status.instances,
                "tools": status.tools.values().collect::<Vec<_>>(),
                "chat_backlog": status.chat_backlog,
                "dead_letters": status.dead_letters,
            }))?
        ),
        Output::Text => print_status(&status),
    }
    if !stranded.is_empty() {
        eprintln!(
            "no instance serves {} and jobs are waiting: start workers for them",
            stranded
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(EXIT_STRANDED);
    }
    Ok(0)
}

/// `toolfleet status`'s exit code when a tool has waiting jobs and no
/// instance (1 is any error, such as an unreachable NATS).
pub const EXIT_STRANDED: i32 = 3;

fn tool_row(tool: &str) -> Value {
    json!({
        "tool": tool, "instances": 0, "backlog": 0, "in_flight": 0,
        "jobs": 0, "errors": 0, "jetstream": 0, "direct": 0, "last_error": null,
    })
}

fn print_status(status: &Status) {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    // A count its instance did not report.
    let known = |v: &Value| v.as_u64().map_or("?".to_string(), |n| n.to_string());
    println!(
        "{:<12} {:<24} {:<8} {:>5} {:>8} {:>7}  STARTED",
        "WORKER", "INSTANCE", "VERSION", "TOOLS", "JOBS", "ERRORS"
    );
    for i in &status.instances {
        println!(
            "{:<12} {:<24} {:<8} {:>5} {:>8} {:>7}  {}",
            i["worker"].as_str().unwrap_or(""),
            i["id"].as_str().unwrap_or(""),
            i["version"].as_str().unwrap_or(""),
            n(&i["tools"]),
            known(&i["jobs"]),
            known(&i["errors"]),
            i["started"].as_str().unwrap_or("?"),
        );
    }
    if status.instances.is_empty() {
        println!("(no worker instance answered)");
    }
    println!();
    println!(
        "{:<40} {:>9} {:>8} {:>9} {:>8} {:>7}  LAST ERROR",
        "TOOL", "INSTANCES", "BACKLOG", "IN-FLIGHT", "JOBS", "ERRORS"
    );
    let now = toolfleet_protocol::now_ms();
    for row in status.tools.values() {
        let last = &row["last_error"];
        let last = if last.is_null() {
            String::new()
        } else {
            let ago = now.saturating_sub(n(&last["at_ms"])) / 1000;
            format!(
                "{}: {} ({ago} s ago)",
                last["code"].as_str().unwrap_or(""),
                crate::cli::one_line(last["message"].as_str().unwrap_or(""), 60)
            )
        };
        println!(
            "{:<40} {:>9} {:>8} {:>9} {:>8} {:>7}  {last}",
            row["tool"].as_str().unwrap_or(""),
            n(&row["instances"]),
            n(&row["backlog"]),
            n(&row["in_flight"]),
            n(&row["jobs"]),
            n(&row["errors"]),
        );
    }
    println!();
    let shown = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
    println!(
        "chat jobs waiting: {}   dead letters kept: {}",
        shown(status.chat_backlog),
        shown(status.dead_letters)
    );
}

/// `toolfleet events`: the events of invocation `invocation_id` of
/// `tenant` as the history stream keeps them (two hours; every event but
/// the deltas — the answer's text is in `completed`), in order; with
/// `follow`, a running invocation's next ones until its terminal event.
/// Exits 0 once a terminal event was shown (1 when it was an error), 1
/// when the stream holds nothing of the invocation (unknown, still queued
/// or expired), 2 when it is still running and `follow` is off.
pub async fn events(
    nats: &NatsArgs,
    invocation_id: &str,
    tenant: &str,
    follow: bool,
    output: Output,
) -> anyhow::Result<i32> {
    if !toolfleet_protocol::valid_tenant(tenant) {
        eprintln!("toolfleet events: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if !toolfleet_protocol::valid_invocation_id(invocation_id) {
        eprintln!("toolfleet events: {invocation_id:?} is not an invocation id");
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
    let mut printer = EventPrinter::new(output);
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
                crate::cli::one_line(text, 160),
                references.len(),
                usage.total_tokens
            ),
            ChatEventBody::Error { code, message } => {
                format!("{code}: {}", crate::cli::one_line(message, 160))
            }
            _ => {
                if let Some(o) = v.as_object_mut() {
                    o.remove("type");
                }
                crate::cli::one_line(&v.to_string(), 160)
            }
        };
        println!("{clock} {:>4} {kind:<14} {detail}", event.seq);
        terminal
    }
}

/// `toolfleet approve`: sends `approval` for a held call of
/// `invocation_id` and prints the orchestrator's answer.
pub(crate) async fn approve(
    invocation_id: &str,
    approval: &toolfleet_protocol::Approval,
    tenant: &str,
    wait: Duration,
    nats: &NatsArgs,
) -> anyhow::Result<i32> {
    if !toolfleet_protocol::valid_tenant(tenant) {
        eprintln!("toolfleet approve: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if !toolfleet_protocol::valid_invocation_id(invocation_id) {
        eprintln!("toolfleet approve: {invocation_id:?} is not an invocation id");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let body = serde_json::to_vec(approval)?;
    // Checked here as the orchestrator will check it: a clear error
    // without a round trip.
    if let Err(e) = toolfleet_protocol::Approval::decode(&body) {
        eprintln!("toolfleet approve: {e}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-approve").await?;
    let subject = subjects.chat_approve(tenant, invocation_id);
    let reply = match tokio::time::timeout(wait, client.request(subject, body.into())).await {
        Err(_) => {
            eprintln!(
                "toolfleet approve: no answer within {} s (is an orchestrator running?); the decision may or may not be recorded: send it again (a repeat of a recorded one is refused as already_decided)",
                wait.as_secs()
            );
            return Ok(1);
        }
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            eprintln!(
                "toolfleet approve: no orchestrator is running (or this identity may not approve for tenant {tenant}); nothing was recorded"
            );
            return Ok(1);
        }
        Ok(Err(e)) => anyhow::bail!("approval request: {e}"),
        Ok(Ok(msg)) => msg,
    };
    let reply: toolfleet_protocol::approval::ApprovalReply = serde_json::from_slice(&reply.payload)
        .map_err(|e| anyhow::anyhow!("the orchestrator's answer cannot be read: {e}"))?;
    if reply.ok {
        let what = match approval.decision {
            toolfleet_protocol::approval::ApprovalDecision::Approve => "approved",
            toolfleet_protocol::approval::ApprovalDecision::Deny => "denied",
        };
        println!(
            "{} {what}; {invocation_id} resumes once every held call of its turn is decided",
            approval.call_id
        );
        Ok(0)
    } else {
        eprintln!(
            "toolfleet approve: refused ({}): {}",
            reply.code.as_deref().unwrap_or("error"),
            reply.error.as_deref().unwrap_or("")
        );
        Ok(1)
    }
}
