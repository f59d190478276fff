//! `toolfleet bench` from its arguments to its report: start the fleet in
//! the asked shape ([`crate::bench_fleet`]), warm up, drive the load
//! ([`crate::bench`]), measure the floors on the same servers
//! ([`crate::floor`]) — and, for an LLM tool, the direct call to the same
//! model — read the orchestrator's memory, print a table (or JSON) and
//! write the chart ([`crate::svg`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use toolfleet_protocol::tools::{ToolDefinition, ToolId};

use crate::bench::{
    Load, Memory, Op, Ratios, Summary, ToolCaller, chat_op, drive, interleave, table,
};
use crate::bench_fleet::{BenchFleet, OrchestratorMemory, SLEEP_TOOL, Sampler, Shape};
use crate::demo::DEMO_QUESTIONS;
use crate::floor::Floor;
use crate::local::LocalArgs;

/// What `toolfleet bench` drives through the fleet.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchMode {
    /// Raw tool calls: a tool job on the tools stream, the result awaited
    /// on a reply inbox (no orchestrator, no model).
    Tool,
    /// Whole chat jobs: model calls, tool calls, citations and events.
    Chat,
    /// A quiet tenant's chat jobs alone and beside a noisy one (a backlog,
    /// poisons, a cancel flood, a slow webhook), two flooding tenants'
    /// shares by weight, and fair dispatch against one FIFO, on servers
    /// of its own ([`crate::bench_noisy`]).
    Noisy,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Raw tool calls or whole chat jobs.
    #[arg(long, value_enum, default_value_t = BenchMode::Chat)]
    pub mode: BenchMode,
    /// Operations to run (after the warm-up). With --duration, whichever
    /// ends first.
    #[arg(long, visible_alias = "jobs")]
    pub count: Option<usize>,
    /// Run for this many seconds instead of (or at most, with --count) a
    /// count.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Operations in flight at once (also the orchestrator's limit).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Operations before the measured run, discarded (default: one batch
    /// of --concurrency).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Tool mode: the tool to call. Default: bench:sleep@1.0.0 when
    /// --tool-delay-ms is given, else system:current_datetime@1.0.0.
    #[arg(long)]
    pub tool: Option<String>,
    /// Tool mode: the tool's arguments (JSON object).
    #[arg(long)]
    pub tool_args: Option<String>,
    /// Tool mode: call the bench's own tool (`bench:sleep`), which waits
    /// this long: a stand-in for a tool's own work.
    #[arg(long)]
    pub tool_delay_ms: Option<u64>,
    /// Chat mode, and tool mode with an LLM tool: the scripted model's
    /// pause before every first token, in ms (a slow model; each chat job
    /// makes two model calls).
    #[arg(long, default_value_t = 0)]
    pub model_delay_ms: u64,
    /// The scripted model's script (no artificial delay of its own).
    #[arg(long, default_value = "examples/bench-script.json")]
    pub script: PathBuf,
    /// Run the scripted model in a process of its own.
    #[arg(long)]
    pub model_process: bool,
    /// Run the model, the orchestrator (`toolfleet-orchestrator` beside
    /// this binary) and the workers as processes of their own; the
    /// orchestrator's memory is then read from /proc.
    #[arg(long)]
    pub processes: bool,
    /// Worker processes (with --processes).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Tool jobs each worker process (or the in-process workers) runs at
    /// once. Default: --concurrency.
    #[arg(long)]
    pub worker_concurrency: Option<usize>,
    /// Seconds an operation may take before it counts as a `timeout`.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG chart of the latency distributions here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Chat mode: print the event timeline of every job slower than this,
    /// in ms.
    #[arg(long, default_value_t = 10_000)]
    pub slow_ms: u64,
    /// Also measure the transport floors on the same server under the same
    /// load (a JetStream work-queue round trip, a core NATS
    /// request-reply; for an LLM tool in tool mode, also a direct call to
    /// the same model with the tool's own request) and print the fleet's
    /// figures as ratios to them.
    #[arg(long)]
    pub floor: bool,
    /// Replicas of the streams the bench's fleet and floors create (3 on a
    /// 3-node cluster given with `--nats-url`: the fleet and the JetStream
    /// floor both on R3 streams).
    #[arg(long, env = toolfleet_service::args::ENV_STREAM_REPLICAS, default_value_t = 1)]
    pub stream_replicas: usize,
    /// Tool mode: the data source of the calls' invocation (what a
    /// retrieval tool searches; the bench's corpus is `handbook`).
    #[arg(long)]
    pub data_source: Option<String>,
    #[command(flatten)]
    pub local: LocalArgs,
}

/// Operations when neither `--count` nor `--duration` is given.
const DEFAULT_COUNT: usize = 500;

/// Everything a run measured (the `--json` report).
#[derive(Debug, serde::Serialize)]
struct Report {
    mode: BenchMode,
    /// Tool mode: the tool called and its arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_arguments: Option<serde_json::Value>,
    /// Tool mode, an LLM tool: the model it calls (`deployment/model`, the
    /// scripted stand-in), which the direct model call floor calls too.
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    /// Chat mode: the scripted model's first-token delay.
    #[serde(skip_serializing_if = "Option::is_none")]
    model_delay_ms: Option<u64>,
    processes: bool,
    model_process: bool,
    worker_processes: usize,
    worker_concurrency: usize,
    load: Load,
    fleet: Summary,
    floors: Vec<Summary>,
    ratios: Vec<Ratios>,
    #[serde(skip_serializing_if = "Option::is_none")]
    orchestrator_memory: Option<OrchestratorMemory>,
    /// Peak RSS of the bench's own process (the whole fleet when it runs
    /// in-process), KiB.
    bench_process_peak_rss_kib: u64,
}

/// `toolfleet bench`: exit 0 when every measured operation succeeded, 1
/// when one failed.
pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    if args.mode == BenchMode::Noisy {
        return crate::bench_noisy::run(&crate::bench_noisy::NoisyArgs {
            count: args.count,
            concurrency: args.concurrency,
            model_delay_ms: args.model_delay_ms,
            timeout_secs: args.timeout_secs,
            json: args.json,
        })
        .await;
    }
    toolfleet_service::serve::raise_fd_limit();
    toolfleet_protocol::streams::set_default_replicas(args.stream_replicas);
    let load = load_of(&args)?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let (tool, tool_arguments) = tool_under_test(&args)?;
    // An LLM tool under test needs the model and the LLM tools family; its
    // definition also gives the direct model call floor its request.
    let llm_tool = match &tool {
        Some(tool) => llm_tool_definition(&args.local.defs.dir, tool)?,
        None => None,
    };
    let shape = Shape {
        chat: args.mode == BenchMode::Chat,
        llm_tools: llm_tool.is_some(),
        model_process: args.model_process,
        processes: args.processes,
        workers: args.workers.max(1),
        worker_concurrency: args.worker_concurrency.unwrap_or(load.concurrency),
        orchestrator_in_flight: load.concurrency,
        script: args.script.clone(),
        model_delay: Duration::from_millis(args.model_delay_ms),
    };
    announce(&args, &load);
    let fleet = BenchFleet::start(&args.local, &shape).await?;
    let under_test = UnderTest {
        tool: tool.as_deref(),
        arguments: tool_arguments.clone(),
        llm_tool: llm_tool.as_ref(),
        timeout,
    };
    let result = measure(&args, &fleet, &load, &under_test).await;
    let model = llm_tool
        .as_ref()
        .and(fleet.models.as_ref())
        .and_then(|models| toolfleet_worker_llm::default_model_of(&models.models()));
    let own_peak = Memory::of("self").unwrap_or_default().hwm_kib;
    fleet.stop().await;
    let (summary, floors, memory) = result?;

    let ratios: Vec<Ratios> = floors.iter().map(|f| Ratios::of(&summary, f)).collect();
    if let Some(path) = &args.svg {
        write_chart(path, &args, &load, &summary, &floors)?;
    }
    let failed = summary.errors;
    let report = Report {
        mode: args.mode,
        tool,
        tool_arguments,
        model,
        model_delay_ms: (args.mode == BenchMode::Chat || llm_tool.is_some())
            .then_some(args.model_delay_ms),
        processes: args.processes,
        model_process: args.model_process || args.processes,
        worker_processes: if args.processes { shape.workers } else { 0 },
        worker_concurrency: shape.worker_concurrency,
        load,
        fleet: summary,
        floors,
        ratios,
        orchestrator_memory: memory,
        bench_process_peak_rss_kib: own_peak,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

/// The load of the flags: `--concurrency` for `--count` operations or
/// `--duration` ([`DEFAULT_COUNT`] when neither is given).
fn load_of(args: &BenchArgs) -> anyhow::Result<Load> {
    let duration = args
        .duration
        .map(Duration::try_from_secs_f64)
        .transpose()
        .context("--duration")?;
    Ok(Load {
        concurrency: args.concurrency.max(1),
        count: match (args.count, duration) {
            (None, None) => Some(DEFAULT_COUNT),
            (count, _) => count,
        },
        duration,
    })
}

/// Tool mode: the tool to call and its arguments (by default the bench's
/// own tool with `--tool-delay-ms`, else `system:current_datetime`);
/// chat mode: none.
fn tool_under_test(
    args: &BenchArgs,
) -> anyhow::Result<(Option<String>, Option<serde_json::Value>)> {
    if args.mode == BenchMode::Chat {
        return Ok((None, None));
    }
    let tool = match (&args.tool, args.tool_delay_ms) {
        (Some(t), _) => t.clone(),
        (None, Some(_)) => SLEEP_TOOL.to_string(),
        (None, None) => "system:current_datetime@1.0.0".to_string(),
    };
    let arguments: serde_json::Value = match (&args.tool_args, args.tool_delay_ms) {
        (Some(a), _) => serde_json::from_str(a).context("--tool-args is not JSON")?,
        (None, Some(ms)) if tool == SLEEP_TOOL => serde_json::json!({ "ms": ms }),
        _ => serde_json::json!({}),
    };
    Ok((Some(tool), Some(arguments)))
}

/// The run's first line on stderr: mode, concurrency and extent.
fn announce(args: &BenchArgs, load: &Load) {
    eprintln!(
        "toolfleet bench --mode {}: {} in flight, {}",
        match args.mode {
            BenchMode::Tool => "tool",
            BenchMode::Chat => "chat (the scripted stand-in model)",
            BenchMode::Noisy => "noisy",
        },
        load.concurrency,
        match (load.count, load.duration) {
            (Some(c), Some(d)) => format!("{c} operations or {d:?}"),
            (Some(c), None) => format!("{c} operations"),
            (None, Some(d)) => format!("for {d:?}"),
            (None, None) => String::new(),
        },
    );
}

/// `--svg PATH`: the latency chart of the fleet and its floors.
fn write_chart(
    path: &std::path::Path,
    args: &BenchArgs,
    load: &Load,
    summary: &Summary,
    floors: &[Summary],
) -> anyhow::Result<()> {
    let mut series = vec![crate::svg::Series {
        name: &summary.name,
        sorted_ms: &summary.sorted_ms,
    }];
    series.extend(floors.iter().map(|f| crate::svg::Series {
        name: &f.name,
        sorted_ms: &f.sorted_ms,
    }));
    let title = format!(
        "toolfleet bench --mode {} · {} in flight",
        serde_json::to_value(args.mode)?
            .as_str()
            .unwrap_or_default(),
        load.concurrency
    );
    std::fs::write(path, crate::svg::latency_cdf(&title, &series))
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("• latency chart written to {}", path.display());
    Ok(())
}

/// The definition of `tool` when it is a declarative LLM tool of
/// `definitions` (one with a prompt, served by the LLM tools family);
/// `None` for any other tool. (`content:generate_image` is not one: the
/// bench gives that family no image model, so it is not served.)
fn llm_tool_definition(
    definitions: &std::path::Path,
    tool: &str,
) -> anyhow::Result<Option<ToolDefinition>> {
    let Ok(id) = tool.parse::<ToolId>() else {
        // Refused with its reason when the calls are built.
        return Ok(None);
    };
    let served = toolfleet_protocol::tools::load_dir(definitions)
        .with_context(|| format!("reading the tool definitions in {}", definitions.display()))?
        .into_iter()
        .find(|d| d.id == id)
        .filter(toolfleet_worker_llm::is_declarative);
    Ok(served)
}

type Measured = (Summary, Vec<Summary>, Option<OrchestratorMemory>);

/// What tool mode calls (chat mode: no tool), and how long an operation
/// may take.
struct UnderTest<'a> {
    tool: Option<&'a str>,
    arguments: Option<serde_json::Value>,
    /// The tool's definition when it is an LLM tool.
    llm_tool: Option<&'a ToolDefinition>,
    timeout: Duration,
}

/// Warms up, then drives the fleet (and the floors asked for, in
/// alternating rounds) under `load`: the fleet's summary, the floors' and
/// the orchestrator's memory.
async fn measure(
    args: &BenchArgs,
    fleet: &BenchFleet,
    load: &Load,
    under_test: &UnderTest<'_>,
) -> anyhow::Result<Measured> {
    let (op, name) = fleet_op(args, fleet, under_test).await?;
    let warm = match args.warmup {
        Some(n) => Load {
            count: Some(n),
            duration: None,
            ..*load
        },
        None => load.warm_up(),
    };
    settle(fleet).await;
    if warm.count != Some(0) {
        eprint!("• warming up ({} operations) … ", warm.count.unwrap_or(0));
        let w = drive("warm-up", &warm, op.clone()).await;
        eprintln!("{} ok, {} errors {:?}", w.ok, w.errors, w.error_codes);
    }
    let floors = floors(args, fleet, under_test, &warm).await?;
    let rounds = if floors.is_empty() { 1 } else { load.rounds() };
    let mut sides = vec![(name, op)];
    sides.extend(floors.iter().map(|f| (f.name.to_string(), f.op.clone())));
    // The orchestrator's idle memory is read after the warm-up: its first
    // jobs build what every later job shares (the tokenizer's tables for
    // the tool-result cap alone are ~45 MiB), which is no invocation's own.
    let sampler = fleet.orchestrator.as_ref().map(Sampler::start);
    if floors.is_empty() {
        eprintln!("• measuring …");
    } else {
        eprintln!(
            "• measuring the fleet and the floors on the same server, in {rounds} alternating rounds …"
        );
    }
    let mut summaries = interleave(load, &sides, rounds).await;
    let memory = match sampler {
        Some(s) => Some(s.finish().await),
        None => None,
    };
    for floor in floors {
        floor.stop().await;
    }
    let summary = summaries.remove(0);
    Ok((summary, summaries, memory))
}

/// The fleet's operation (a tool call, or a chat job asking the demo's
/// questions in turn) and its name in the report.
async fn fleet_op(
    args: &BenchArgs,
    fleet: &BenchFleet,
    under_test: &UnderTest<'_>,
) -> anyhow::Result<(Op, String)> {
    Ok(match under_test.tool {
        Some(tool) => {
            let id = tool
                .parse()
                .map_err(|e| anyhow::anyhow!("--tool {tool:?}: {e}"))?;
            let caller = ToolCaller::new(
                &fleet.client,
                &fleet.subjects,
                id,
                under_test.arguments.clone().unwrap_or_default(),
                under_test.timeout,
            )
            .await?;
            let caller = caller.with_data_source(args.data_source.clone());
            (caller.op(), format!("fleet: tool calls ({tool})"))
        }
        None => (
            chat_op(
                fleet.client.clone(),
                fleet.subjects.clone(),
                DEMO_QUESTIONS.iter().map(|q| q.to_string()).collect(),
                under_test.timeout,
                Duration::from_millis(args.slow_ms),
            ),
            "fleet: chat jobs".to_string(),
        ),
    })
}

/// A worker's first jobs (published within its cancel-hearing margin of
/// its start) read the cancel tombstone from Redis; after that a new
/// call's first delivery does not. Waits that out, to measure the steady
/// state.
async fn settle(fleet: &BenchFleet) {
    let settle =
        toolfleet_worker::runtime::CANCEL_HEARING_MARGIN.saturating_sub(fleet.started.elapsed());
    if !settle.is_zero() {
        eprintln!(
            "• waiting {:.1} s: workers read Redis for the jobs of their first {} s",
            settle.as_secs_f64(),
            toolfleet_worker::runtime::CANCEL_HEARING_MARGIN.as_secs()
        );
        tokio::time::sleep(settle).await;
    }
}

/// The floors of `--floor`, set up on the fleet's server and, those with
/// connections of their own to fill, warmed up as the fleet was (`warm`).
async fn floors(
    args: &BenchArgs,
    fleet: &BenchFleet,
    under_test: &UnderTest<'_>,
    warm: &Load,
) -> anyhow::Result<Vec<Floor>> {
    // The floors run on the same server, in rounds that alternate with the
    // fleet's, so that both see the machine's other load alike.
    let mut floors = Vec::new();
    if args.floor {
        floors.push(Floor::jetstream(&fleet.client, &fleet.nats_url).await?);
        floors.push(Floor::request_reply(&fleet.client, &fleet.nats_url).await?);
        if under_test.tool.is_none()
            && let Some(models) = &fleet.models
        {
            let direct = crate::floor_chat::DirectChat::new(
                models,
                &args.local.defs.dir,
                &args.local.corpus,
                DEMO_QUESTIONS.iter().map(|q| q.to_string()).collect(),
                under_test.timeout,
            )
            .await?;
            floors.push(Floor::direct_chat(direct.op()));
        }
        if let (Some(definition), Some(models)) = (under_test.llm_tool, &fleet.models) {
            floors.push(
                Floor::direct_model(
                    models,
                    &args.local.defs.dir,
                    definition,
                    under_test.arguments.clone().unwrap_or_default(),
                    under_test.timeout,
                )
                .await?,
            );
        }
    }
    for floor in floors.iter().filter(|f| f.warm_up) {
        if warm.count != Some(0) {
            eprint!(
                "• warming up the {} … ",
                floor.name.trim_start_matches("floor: ")
            );
            let w = drive("warm-up", warm, floor.op.clone()).await;
            eprintln!("{} ok, {} errors {:?}", w.ok, w.errors, w.error_codes);
        }
    }
    Ok(floors)
}

fn render(r: &Report) -> String {
    let mut out = String::new();
    let mut rows = vec![&r.fleet];
    rows.extend(r.floors.iter());
    out.push_str(&table(&rows));
    if r.mode == BenchMode::Chat && r.fleet.ok > 0 {
        out.push_str(&format!(
            "chat jobs: {:.2} tool calls per job, model first-token delay {} ms\n",
            r.fleet.tool_calls as f64 / r.fleet.ok as f64,
            r.model_delay_ms.unwrap_or(0)
        ));
    }
    if !r.fleet.error_codes.is_empty() {
        out.push_str(&format!("errors: {:?}\n", r.fleet.error_codes));
    }
    for ratio in &r.ratios {
        out.push_str(&format!(
            "fleet / {}: p50 {:.2}x, p90 {:.2}x, p99 {:.2}x, throughput {:.3}x\n",
            ratio.floor.trim_start_matches("floor: "),
            ratio.p50,
            ratio.p90,
            ratio.p99,
            ratio.throughput
        ));
    }
    if r.mode == BenchMode::Chat && !r.ratios.is_empty() {
        out.push_str("(a chat job is two model calls, its tool calls, citations and ~30 events; a floor operation is one round trip)\n");
    }
    if let Some(model) = &r.model {
        out.push_str(&format!(
            "model: {model} (the scripted stand-in), first-token delay {} ms; the direct model call is the tool's request without the fleet\n",
            r.model_delay_ms.unwrap_or(0)
        ));
    }
    if let Some(m) = &r.orchestrator_memory {
        out.push_str(&format!(
            "orchestrator process {}: idle RSS {:.1} MiB, peak RSS {:.1} MiB (VmHWM {:.1} MiB) with up to {} chat jobs in flight: {:.1} KiB per invocation\n",
            m.pid,
            m.idle_rss_kib as f64 / 1024.0,
            m.peak_rss_kib as f64 / 1024.0,
            m.hwm_kib as f64 / 1024.0,
            m.max_in_flight,
            m.per_invocation_kib
        ));
    }
    out.push_str(&format!(
        "bench process peak RSS {:.1} MiB{}\n",
        r.bench_process_peak_rss_kib as f64 / 1024.0,
        if r.processes {
            " (load generator only)"
        } else if r.model_process || (r.mode == BenchMode::Tool && r.model.is_none()) {
            " (fleet and load generator)"
        } else {
            " (fleet, model and load generator)"
        }
    ));
    out
}
