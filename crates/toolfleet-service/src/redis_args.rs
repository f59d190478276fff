//! The Redis part of a binary's configuration: where the citation store
//! and result ledger live and how long an invocation's keys last.

use std::time::Duration;

use clap::Args;

pub const ENV_REDIS_URL: &str = "TOOLFLEET_REDIS_URL";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Where Redis is and how long invocation keys live.
#[derive(Args, Debug, Clone)]
pub struct RedisArgs {
    /// Redis URL (the citation store and result ledger).
    #[arg(id = "redis_url", long = "redis-url", env = ENV_REDIS_URL, default_value = DEFAULT_REDIS_URL, hide_env_values = true)]
    pub url: String,
    /// Lifetime of an invocation's citation keys, in seconds.
    #[arg(
        long = "citation-ttl",
        env = "TOOLFLEET_CITATION_TTL",
        default_value_t = 86_400
    )]
    pub ttl_secs: u64,
}

impl RedisArgs {
    /// How long an invocation's keys live.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }
}
