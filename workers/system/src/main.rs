//! `toolfleet-worker-system`: serves system:* tools (current date and time).
//! Start more copies to scale the pool: they share one durable consumer per
//! tool. Configured by flags and `TOOLFLEET_*` environment variables.

use toolfleet_worker::process::NoArgs;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-system",
        toolfleet_worker::build_info!(),
        "toolfleet worker: serves system:* tools (current date and time).",
        "0.0.0.0:9465",
        async |args, _: &NoArgs| toolfleet_worker_system::worker(&args.defs.dir),
    )
    .await
}
