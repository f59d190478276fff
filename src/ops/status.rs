//! `toolfleet status`: the fleet at a glance — every worker instance, the
//! tools served with their backlog and last errors, the chat backlog and
//! the dead letters kept.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use clap::Args;
use futures::StreamExt;
use serde_json::{Value, json};
use toolfleet_protocol::Subjects;
use toolfleet_protocol::catalog::{META_TOOL_ID, META_WORKER};
use toolfleet_service::args::NatsArgs;

use crate::common::{Output, one_line};

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// `text` (tables) or `json`.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    output: Output,
    /// How long to collect the workers' answers, in ms.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    wait_ms: u64,
    #[command(flatten)]
    nats: NatsArgs,
}

/// What `toolfleet status` gathered.
#[derive(Debug, Default)]
struct Status {
    /// One per worker instance that answered `$SRV.STATS`.
    instances: Vec<Value>,
    /// By tool id.
    tools: BTreeMap<String, Value>,
    dead_letters: Option<u64>,
    /// Chat jobs waiting, of every tenant.
    chat_backlog: Option<u64>,
    /// Chat jobs delivered to an orchestrator and not yet acked.
    chat_in_flight: Option<u64>,
    /// `{tenant, backlog, in_flight}` of each tenant with chat jobs.
    chat_tenants: Vec<Value>,
}

/// The instances `$SRV.INFO` found, by id: where each is in
/// [`Status::instances`] and its tools (endpoint name → tool id).
type Known = BTreeMap<String, (usize, BTreeMap<String, String>)>;

/// `toolfleet status`: every worker instance (from `$SRV.INFO` and
/// `$SRV.STATS`), every tool (instances serving it, backlog and jobs in
/// flight from its consumer, jobs and errors from the instances' stats,
/// the newest error), the chat backlog and the dead letters kept. Exits 0;
/// [`EXIT_STRANDED`] when a tool has jobs waiting or in flight and no
/// instance serves it.
pub async fn run(args: StatusArgs) -> anyhow::Result<i32> {
    let (nats, wait) = (&args.nats, Duration::from_millis(args.wait_ms));
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
    let known = status.add_infos(&infos, &subjects);
    let counted = status.add_stats(&stats, &known);
    if counted < known.len() {
        eprintln!(
            "{} of {} worker instance(s) did not answer $SRV.STATS within {} ms (busy, or no \
             permission): their job counts are missing",
            known.len() - counted,
            known.len(),
            wait.as_millis()
        );
    }
    status.add_streams(&js, &subjects).await;
    status.report(args.output)
}

impl Status {
    /// The row of tool `id`, made on first sight.
    fn tool(&mut self, id: &str) -> &mut Value {
        self.tools
            .entry(id.to_owned())
            .or_insert_with(|| tool_row(id))
    }

    /// The instances of this fleet (by prefix) that answered `$SRV.INFO`,
    /// and the tools each serves.
    fn add_infos(&mut self, infos: &[bytes::Bytes], subjects: &Subjects) -> Known {
        let mut known = Known::new();
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
                let row = self.tool(tool);
                row["instances"] = (row["instances"].as_u64().unwrap_or(0) + 1).into();
            }
            known.insert(info.id.clone(), (self.instances.len(), tools.clone()));
            self.instances.push(json!({
                "id": info.id,
                "worker": info.metadata.get(META_WORKER).cloned().unwrap_or_default(),
                "version": info.version,
                "started": null,
                "tools": tools.len(),
                "jobs": null,
                "errors": null,
            }));
        }
        known
    }

    /// The counts of the `$SRV.STATS` answers of `known` instances, added
    /// to their instances and tools; how many answered.
    fn add_stats(&mut self, stats: &[bytes::Bytes], known: &Known) -> usize {
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
                let row = self.tool(tool);
                for k in ["jobs", "errors", "jetstream", "direct"] {
                    row[k] = (row[k].as_u64().unwrap_or(0) + n(k)).into();
                }
                let newer = data["last_error"]["at_ms"].as_u64().unwrap_or(0)
                    > row["last_error"]["at_ms"].as_u64().unwrap_or(0);
                if newer {
                    row["last_error"] = data["last_error"].clone();
                }
            }
            let instance = &mut self.instances[*at];
            instance["started"] = stat.started.to_string().into();
            instance["jobs"] = jobs.into();
            instance["errors"] = errors.into();
        }
        counted
    }

    /// The pools' queues (the tools stream's consumers), the dead letters
    /// kept and the chat backlog; what cannot be read stays unknown.
    async fn add_streams(&mut self, js: &jetstream::Context, subjects: &Subjects) {
        if let Ok(mut stream) = js.get_stream(subjects.tools_stream()).await {
            let _ = stream.info().await;
            let mut consumers = stream.consumers();
            while let Some(Ok(info)) = consumers.next().await {
                let Some(tool) = subjects.tool_of_subject(&info.config.filter_subject) else {
                    continue;
                };
                let row = self.tool(&tool);
                row["backlog"] = info.num_pending.into();
                row["in_flight"] = (info.num_ack_pending as u64).into();
            }
        }
        if let Ok(mut s) = js.get_stream(subjects.dead_letters_stream()).await
            && let Ok(info) = s.info().await
        {
            self.dead_letters = Some(info.state.messages);
        }
        if let Ok(s) = js.get_stream(subjects.chat_stream()).await {
            self.add_chat(&s, subjects).await;
        }
    }

    /// The chat backlog and the jobs in flight, by tenant (both lanes):
    /// from the tenants' chat consumers (fair dispatch), and for a lane
    /// whose consumer no orchestrator has made yet, its jobs stored.
    async fn add_chat(&mut self, stream: &jetstream::stream::Stream, subjects: &Subjects) {
        let mut tenants: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut opened = std::collections::HashSet::new();
        let mut consumers = stream.consumers();
        while let Some(next) = consumers.next().await {
            let Ok(info) = next else { return };
            if let Some((tenant, lane)) = subjects.consumer_lane(&info.name) {
                let t = tenants.entry(tenant.to_owned()).or_insert((0, 0));
                t.0 += info.num_pending;
                t.1 += info.num_ack_pending as u64;
                opened.insert((tenant.to_owned(), lane));
            }
        }
        // Jobs of a lane no orchestrator has opened a consumer for yet.
        for filter in [subjects.chat_submit_all(), subjects.chat_batch_all()] {
            if let Ok(mut stored) = stream.info_with_subjects(filter).await {
                while let Some(Ok((subject, n))) = stored.next().await {
                    if let Some((tenant, lane)) = subjects.lane_tenant(&subject)
                        && !opened.contains(&(tenant.to_owned(), lane))
                    {
                        tenants.entry(tenant.to_owned()).or_insert((0, 0)).0 += n as u64;
                    }
                }
            }
        }
        self.chat_backlog = Some(tenants.values().map(|t| t.0).sum());
        self.chat_in_flight = Some(tenants.values().map(|t| t.1).sum());
        self.chat_tenants = tenants
            .into_iter()
            .filter(|(_, (backlog, in_flight))| backlog + in_flight > 0)
            .map(|(tenant, (backlog, in_flight))| {
                json!({ "tenant": tenant, "backlog": backlog, "in_flight": in_flight })
            })
            .collect();
    }

    /// Prints the status as `output`; the exit code ([`EXIT_STRANDED`]
    /// when a tool has waiting jobs and no instance).
    fn report(&self, output: Output) -> anyhow::Result<i32> {
        let stranded: Vec<&String> = self
            .tools
            .iter()
            // A job delivered to an instance that has since gone (in
            // flight to nobody until its ack wait ends) waits as well.
            .filter(|(_, r)| {
                let waiting =
                    r["backlog"].as_u64().unwrap_or(0) + r["in_flight"].as_u64().unwrap_or(0);
                r["instances"] == 0 && waiting > 0
            })
            .map(|(id, _)| id)
            .collect();
        match output {
            Output::Json => println!(
                "{}",
                serde_json::to_string_pretty(&json!({
                    "instances": self.instances,
                    "tools": self.tools.values().collect::<Vec<_>>(),
                    "chat_backlog": self.chat_backlog,
                    "chat_in_flight": self.chat_in_flight,
                    "chat_tenants": self.chat_tenants,
                    "dead_letters": self.dead_letters,
                }))?
            ),
            Output::Text => print_status(self),
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
                one_line(last["message"].as_str().unwrap_or(""), 60)
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
    let by_tenant: Vec<String> = status
        .chat_tenants
        .iter()
        .map(|t| {
            format!(
                "{} {}+{}",
                t["tenant"].as_str().unwrap_or(""),
                n(&t["backlog"]),
                n(&t["in_flight"])
            )
        })
        .collect();
    println!(
        "chat jobs waiting: {}   in flight: {}   dead letters kept: {}",
        shown(status.chat_backlog),
        shown(status.chat_in_flight),
        shown(status.dead_letters)
    );
    if !by_tenant.is_empty() {
        println!("by tenant (waiting+in flight): {}", by_tenant.join(", "));
    }
}
