//! `units-worker`: serves `units:convert@1.0.0`, whose definition it
//! carries. Configured like every toolfleet worker (`--help`):
//! `TOOLFLEET_NATS_URL`, `TOOLFLEET_REDIS_URL`, `TOOLFLEET_SUBJECT_PREFIX`,
//! `TOOLFLEET_METRICS_ADDR` (`TOOLFLEET_TOOL_DEFINITIONS` is not used).

use toolfleet_worker::process::NoArgs;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "units-worker",
        "A third-party toolfleet worker: converts units (units:convert@1.0.0).",
        "0.0.0.0:9470",
        async |_, _: &NoArgs| units_worker::worker(),
    )
    .await
}
