//! `units-worker`: serves `units:convert@1.0.0`, whose definition it
//! carries. Configured like every toolfleet worker (`--help`):
//! `TOOLFLEET_NATS_URL`, `TOOLFLEET_REDIS_URL`, `TOOLFLEET_SUBJECT_PREFIX`,
//! `TOOLFLEET_METRICS_ADDR`; `TOOLFLEET_TOOL_DEFINITIONS` (`--tool-definitions`):
//! `units.convert` definitions there replace the carried one.

use toolfleet_worker::process::NoArgs;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "units-worker",
        toolfleet_worker::build_info!(),
        "A third-party toolfleet worker: converts units (units:convert@1.0.0).",
        "0.0.0.0:9470",
        async |args, _: &NoArgs| units_worker::worker_from(&args.defs.dir),
    )
    .await
}
