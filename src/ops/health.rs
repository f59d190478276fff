//! `toolfleet health`: probe a fleet process's health endpoint, for
//! container images without curl.

use std::time::Duration;

use clap::Args;

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// The endpoint, e.g. `http://127.0.0.1:9465/readyz` (ready: NATS,
    /// Redis and consumers) or `/livez` (the process runs).
    url: String,
    /// How long to wait for the answer.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
}

/// `toolfleet health`: prints the answer; exit 0 when it is 2xx, 1 when it
/// is not or nothing answers, 64 for a URL that is not http(s).
pub async fn run(args: HealthArgs) -> anyhow::Result<i32> {
    let (url, timeout_ms) = (args.url.as_str(), args.timeout_ms);
    let parsed = match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => u,
        Ok(u) => {
            eprintln!("error: {url} is not an http(s) URL ({}:)", u.scheme());
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
        Err(e) => {
            eprintln!("error: {url:?} is not a URL: {e}");
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
    };
    toolfleet_llm::install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(timeout_ms))
        .build()?;
    match client.get(parsed).send().await {
        Ok(response) => {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            print!("{body}");
            if !body.ends_with('\n') {
                println!();
            }
            if status.is_success() {
                Ok(0)
            } else {
                eprintln!("{url}: HTTP {status}");
                Ok(1)
            }
        }
        Err(e) => {
            eprintln!("{url}: no answer: {e}");
            Ok(1)
        }
    }
}
