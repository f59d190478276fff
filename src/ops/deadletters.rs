//! `toolfleet deadletters`: list, show and replay the dead letters (jobs
//! that exhausted their attempts or could not be read, and sink
//! deliveries that failed), kept in the dead-letter stream for 14 days.
//!
//! A tool job's sensitive arguments (its definition's
//! `sensitiveArguments`) are never printed: workers redact them before a
//! dead letter is kept, and `show` and `ls -o json` redact them again for
//! records kept before workers did ([`Sensitive`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use clap::Subcommand;
use toolfleet_protocol::redact::REDACTED;
use toolfleet_protocol::{DeadLetter, DeadLetterKind, Subjects};
use toolfleet_service::args::{NatsArgs, ToolDefsArgs};

use crate::common::Output;

#[derive(Subcommand, Debug)]
pub enum DeadlettersCommand {
    /// The newest dead letters: sequence, time, kind, tool, code, attempts,
    /// invocation.
    Ls {
        /// How many, newest first.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        /// Where tool definitions are read to know a tool's sensitive
        /// arguments (the fleet's live catalog is asked too).
        #[command(flatten)]
        defs: ToolDefsArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// One dead letter, whole (its job's body included), as JSON; a tool
    /// job's sensitive arguments are never shown (every argument's value is
    /// hidden when the tool's definition is not known here).
    Show {
        /// Its sequence in the dead-letter stream (from `ls`).
        seq: u64,
        /// Where tool definitions are read to know a tool's sensitive
        /// arguments (the fleet's live catalog is asked too).
        #[command(flatten)]
        defs: ToolDefsArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Publishes a dead tool or chat job again, after a fix: a tool job to
    /// its tool (refused when no worker's consumer serves it any more), a
    /// chat job to its tenant's submit subject. JetStream counts its
    /// attempts afresh; a tool job's original caller has usually stopped
    /// waiting, so its result goes only to the ledger.
    Replay {
        /// Its sequence in the dead-letter stream (from `ls`).
        seq: u64,
        /// For a chat job: the tenant to submit it as again (a dead letter
        /// does not keep the submit subject's tenant).
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

/// `toolfleet deadletters …`: exit 0 when done, 1 when the dead letter is
/// not there or cannot be replayed, 64 for a malformed tenant.
pub async fn run(command: DeadlettersCommand) -> anyhow::Result<i32> {
    let nats = match &command {
        DeadlettersCommand::Ls { nats, .. }
        | DeadlettersCommand::Show { nats, .. }
        | DeadlettersCommand::Replay { nats, .. } => nats,
    };
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-deadletters").await?;
    let js = jetstream::new(client.clone());
    let stream = dead_letter_stream(&js, &subjects).await?;
    match command {
        DeadlettersCommand::Ls {
            limit,
            output,
            defs,
            ..
        } => {
            let sensitive = Sensitive::new(client, subjects, defs.dir);
            ls(stream, limit, output, sensitive).await
        }
        DeadlettersCommand::Show { seq, defs, .. } => {
            show(&stream, seq, Sensitive::new(client, subjects, defs.dir)).await
        }
        DeadlettersCommand::Replay { seq, tenant, .. } => {
            replay(&js, &subjects, &stream, seq, &tenant).await
        }
    }
}

/// The dead-letter stream, or why it cannot be read.
async fn dead_letter_stream(
    js: &async_nats::jetstream::Context,
    subjects: &toolfleet_protocol::Subjects,
) -> anyhow::Result<async_nats::jetstream::stream::Stream> {
    let name = subjects.dead_letters_stream();
    js.get_stream(&name).await.map_err(|e| {
        anyhow::anyhow!(
            "the dead-letter stream {name} cannot be read ({e}): no orchestrator has started \
             on this prefix yet, or this identity may not read it"
        )
    })
}

/// Dead letter `seq` of `stream`, decoded; `None` when there is none.
async fn dead_letter_at(
    stream: &async_nats::jetstream::stream::Stream,
    seq: u64,
) -> anyhow::Result<Option<(toolfleet_protocol::DeadLetter, String)>> {
    match stream.get_raw_message(seq).await {
        Ok(raw) => {
            let dead: toolfleet_protocol::DeadLetter = serde_json::from_slice(&raw.payload)
                .map_err(|e| anyhow::anyhow!("dead letter {seq} cannot be read: {e}"))?;
            let time = raw
                .time
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            Ok(Some((dead, time)))
        }
        Err(e) if e.to_string().contains("no message found") => Ok(None),
        Err(e) => Err(anyhow::anyhow!("reading dead letter {seq}: {e}")),
    }
}

/// `deadletters ls`: the newest `limit`, newest first.
async fn ls(
    mut stream: jetstream::stream::Stream,
    limit: usize,
    output: Output,
    mut sensitive: Sensitive,
) -> anyhow::Result<i32> {
    let state = stream.info().await?.state.clone();
    let mut rows = Vec::new();
    let mut seq = state.last_sequence;
    while seq >= state.first_sequence && seq > 0 && rows.len() < limit {
        match dead_letter_at(&stream, seq).await {
            Ok(Some((dead, time))) => rows.push((seq, time, dead)),
            Ok(None) => {}
            // One unreadable record does not hide the others.
            Err(e) => eprintln!("{e:#}"),
        }
        seq -= 1;
    }
    match output {
        Output::Json => {
            // The error text of a record kept before workers redacted may
            // quote a sensitive argument.
            for (_, _, dead) in &mut rows {
                sensitive.hide(dead).await;
            }
            let json: Vec<serde_json::Value> = rows
                .iter()
                .map(|(seq, time, dead)| {
                    let mut v = serde_json::to_value(dead).unwrap_or_default();
                    v["seq"] = (*seq).into();
                    v["time"] = time.clone().into();
                    if let Some(o) = v.as_object_mut() {
                        o.remove("job");
                    }
                    v
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&json)?);
        }
        Output::Text => print_rows(&rows),
    }
    Ok(0)
}

/// The rows of `ls` as a table.
fn print_rows(rows: &[(u64, String, DeadLetter)]) {
    println!(
        "{:<6} {:<20} {:<5} {:<36} {:<22} {:<3} INVOCATION",
        "SEQ", "TIME", "KIND", "TOOL", "CODE", "TRY"
    );
    for (seq, time, dead) in rows {
        println!(
            "{:<6} {:<20} {:<5} {:<36} {:<22} {:<3} {}",
            seq,
            time.get(..19).unwrap_or(time),
            dead.kind.as_str(),
            dead.tool_id.as_deref().unwrap_or("-"),
            dead.code,
            dead.attempts,
            dead.invocation_id.as_deref().unwrap_or("-")
        );
    }
    if rows.is_empty() {
        eprintln!("no dead letters");
    }
}

/// `deadletters show`: one, whole, as JSON, its sensitive arguments
/// hidden.
async fn show(
    stream: &jetstream::stream::Stream,
    seq: u64,
    mut sensitive: Sensitive,
) -> anyhow::Result<i32> {
    match dead_letter_at(stream, seq).await? {
        Some((mut dead, time)) => {
            sensitive.hide(&mut dead).await;
            let mut v = serde_json::to_value(&dead)?;
            v["seq"] = seq.into();
            v["time"] = time.into();
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        None => {
            eprintln!("no dead letter {seq} (it may have aged out)");
            Ok(1)
        }
    }
}

/// `deadletters replay`: the job published again where it came from, as
/// a fresh run.
async fn replay(
    js: &jetstream::Context,
    subjects: &Subjects,
    stream: &jetstream::stream::Stream,
    seq: u64,
    tenant: &str,
) -> anyhow::Result<i32> {
    let Some((dead, _)) = dead_letter_at(stream, seq).await? else {
        eprintln!("no dead letter {seq} (it may have aged out)");
        return Ok(1);
    };
    let Some(job) = &dead.job else {
        eprintln!(
            "dead letter {seq} kept no job to replay (its body was not a JSON object: {})",
            dead.code
        );
        return Ok(1);
    };
    let redacted = job
        .get("arguments")
        .and_then(serde_json::Value::as_object)
        .is_some_and(|args| args.values().any(|v| v == REDACTED));
    if redacted {
        eprintln!(
            "dead letter {seq} kept its tool job without its sensitive arguments ({REDACTED}): \
             it cannot be replayed as it was; call the tool again"
        );
        return Ok(1);
    }
    let headers = fresh_headers(&dead, seq);
    let subject = match replay_subject(js, subjects, &dead, seq, tenant).await? {
        Ok(subject) => subject,
        Err(code) => return Ok(code),
    };
    let ack = js
        .publish_with_headers(subject.clone(), headers, serde_json::to_vec(job)?.into())
        .await?
        .await?;
    if ack.duplicate {
        eprintln!(
            "dead letter {seq} was already replayed (the stream's duplicate window still \
             holds that replay): not published again"
        );
        return Ok(1);
    }
    println!(
        "dead letter {seq} replayed to {subject} (stream sequence {})",
        ack.sequence
    );
    Ok(0)
}

/// The dead job's headers for its replay: a fresh run, with no old
/// message id, deadline or attempt. A tool job gets a message id of the
/// replay's own (only the fleet publishes tool jobs); a chat job none,
/// since any tenant's client may write message ids into the chat stream's
/// one duplicate window (the fleet runs one chat job per tenant and
/// invocation id anyway).
fn fresh_headers(dead: &DeadLetter, seq: u64) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    for (k, v) in &dead.headers {
        let stale = [
            toolfleet_protocol::headers::NATS_MSG_ID,
            toolfleet_protocol::headers::DEADLINE,
            toolfleet_protocol::headers::ATTEMPT,
        ];
        if !stale.contains(&k.as_str()) {
            headers.insert(k.as_str(), v.as_str());
        }
    }
    if dead.kind == DeadLetterKind::Tool {
        headers.insert(
            toolfleet_protocol::headers::NATS_MSG_ID,
            format!("replay-{}-{seq}", dead.stream_sequence).as_str(),
        );
    }
    headers
}

/// Where the dead job goes again: its tool (while a worker's consumer
/// serves it) or its tenant's submit subject; `Err(exit code)`, said on
/// stderr, when it cannot be replayed.
async fn replay_subject(
    js: &jetstream::Context,
    subjects: &Subjects,
    dead: &DeadLetter,
    seq: u64,
    tenant: &str,
) -> anyhow::Result<Result<String, i32>> {
    Ok(match dead.kind {
        DeadLetterKind::Tool => {
            let Some(id) = dead
                .tool_id
                .as_deref()
                .and_then(|t| t.parse::<toolfleet_protocol::tools::ToolId>().ok())
            else {
                eprintln!("dead letter {seq} names no tool");
                return Ok(Err(1));
            };
            let consumer = subjects.tool_consumer(&id);
            let tools = js.get_stream(subjects.tools_stream()).await?;
            if tools.consumer_info(&consumer).await.is_err() {
                eprintln!(
                    "no worker serves {id} any more (its consumer {consumer} is gone): \
                     not replayed"
                );
                return Ok(Err(1));
            }
            Ok(subjects.tool(&id))
        }
        DeadLetterKind::Sink => {
            // The event went out on NATS; only its sink missed it, and a
            // sink's delivery is not a job to submit again.
            eprintln!(
                "dead letter {seq} is a sink delivery (its event is in `job`): \
                 not replayable"
            );
            Err(1)
        }
        DeadLetterKind::Chat => {
            // The tenant is the submit subject's, which a dead letter does
            // not keep: the operator names it.
            if !toolfleet_protocol::valid_tenant(tenant) {
                eprintln!("--tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
                return Ok(Err(toolfleet_service::args::EXIT_CONFIG));
            }
            Ok(subjects.chat_submit(tenant))
        }
    })
}

/// What a tool's definition marks sensitive, to hide it on display: read
/// from the definitions directory, else from the fleet's live catalog
/// (asked once, when a tool is not in the directory), remembered per tool.
struct Sensitive {
    client: async_nats::Client,
    subjects: Subjects,
    dir: PathBuf,
    files: Option<Vec<toolfleet_protocol::tools::ToolDefinition>>,
    catalog: Option<toolfleet_protocol::catalog::Catalog>,
    known: HashMap<String, Option<Vec<String>>>,
}

impl Sensitive {
    fn new(client: async_nats::Client, subjects: Subjects, dir: PathBuf) -> Self {
        Self {
            client,
            subjects,
            dir,
            files: None,
            catalog: None,
            known: HashMap::new(),
        }
    }

    /// Hides `dead`'s sensitive arguments (a tool job's), in its job and
    /// its error text. When the tool's definition is known nowhere here,
    /// every argument counts as sensitive (said on stderr).
    async fn hide(&mut self, dead: &mut DeadLetter) {
        if dead.kind != DeadLetterKind::Tool {
            return;
        }
        let Some(arguments) = dead.job.as_ref().and_then(|j| j.get("arguments")) else {
            return;
        };
        let tool = dead.tool_id.clone().unwrap_or_default();
        let names = match self.of(&tool).await {
            Some(names) => names,
            None => {
                eprintln!(
                    "the definition of {tool:?} is known neither in {} nor to a live worker: \
                     every argument's value is hidden",
                    self.dir.display()
                );
                match arguments.as_object() {
                    Some(map) => map.keys().cloned().collect(),
                    None => {
                        if let Some(job) = dead.job.as_mut() {
                            job["arguments"] = REDACTED.into();
                        }
                        return;
                    }
                }
            }
        };
        dead.redact_arguments(&names);
    }

    /// The sensitive arguments of tool `id`, if its definition is known.
    async fn of(&mut self, id: &str) -> Option<Vec<String>> {
        if let Some(known) = self.known.get(id) {
            return known.clone();
        }
        let files = self.files.get_or_insert_with(|| {
            toolfleet_protocol::tools::load_dir(&self.dir).unwrap_or_default()
        });
        let mut found = files
            .iter()
            .find(|d| d.id.to_string() == id)
            .map(|d| d.sensitive_arguments.clone());
        if found.is_none() {
            if self.catalog.is_none() {
                // Best effort: an identity that may not read the catalog
                // finds nothing there.
                let read = toolfleet_protocol::catalog::discover(
                    &self.client,
                    &self.subjects,
                    Duration::from_millis(500),
                    &toolfleet_protocol::catalog::Catalog::default(),
                )
                .await;
                self.catalog = Some(read.unwrap_or_default());
            }
            found = self
                .catalog
                .as_ref()
                .and_then(|c| c.get(id))
                .map(|e| e.definition().sensitive_arguments.clone());
        }
        self.known.insert(id.to_string(), found.clone());
        found
    }
}
