//! `toolfleet`: the command line — chat, demo, up, tools, index, and the
//! scripted model server. All logic lives in `toolfleet::cli`.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = match toolfleet::cli::Cli::try_parse() {
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
    let interactive = matches!(
        cli.command,
        toolfleet::cli::Command::Chat(_)
            | toolfleet::cli::Command::Demo(_)
            | toolfleet::cli::Command::Bench(_)
            | toolfleet::cli::Command::Tools { .. }
            | toolfleet::cli::Command::Blob { .. }
    );
    toolfleet_service::args::init_tracing_with(if interactive { "warn" } else { "info" });
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
    std::process::exit(code);
}
