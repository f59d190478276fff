//! `toolfleet`: the command line — chat, demo, up, tools, index, and the
//! scripted model server. `main` parses, sets up telemetry and calls
//! `toolfleet::cli::run`, which hands each command to its module.

/// Once the reader of our output goes away (`toolfleet tools list |
/// head`), stop quietly with success, as Unix tools do, instead of
/// panicking on the next write.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to std") && message.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}

#[tokio::main]
async fn main() {
    quiet_on_broken_pipe();
    let build = toolfleet_service::build_info!();
    let cli = match toolfleet_service::args::try_parse::<toolfleet::cli::Cli>(build) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() {
                toolfleet_service::args::EXIT_CONFIG
            } else {
                0
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    // Interactive commands print their own progress; servers log.
    let interactive = !matches!(
        cli.command,
        toolfleet::cli::Command::Up(_)
            | toolfleet::cli::Command::Gateway(_)
            | toolfleet::cli::Command::BenchWorker(_)
            | toolfleet::cli::Command::ScriptedModel(_)
    );
    let telemetry = toolfleet_service::telemetry::init(
        "toolfleet",
        if interactive { "warn" } else { "info" },
        &cli.telemetry,
    );
    let code = match toolfleet::cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            let code = toolfleet_service::args::exit_code_of(&e);
            if code == toolfleet_service::args::EXIT_CONFIG {
                eprintln!("configuration error: {e:#}");
            } else {
                eprintln!("error: {e:#}");
            }
            code
        }
    };
    telemetry.shutdown().await;
    std::process::exit(code);
}
