//! Delivery attempts of routed events, counted apart from JetStream's
//! delivery count: the relay puts an event back unattempted when its
//! tenant's share of deliveries is in use (a redelivery NATS counts), so
//! the attempt cap counts real attempts here instead.

use std::time::Duration;

use crate::{CitationError, CitationStore};

/// Adds one to `KEYS[1]` and sets its TTL to `ARGV[1]` ms.
const COUNT: &str = r"
local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return n
";

impl CitationStore {
    /// Counts one more delivery attempt of the sinks-stream message
    /// `stream_sequence` of `tenant`'s, and returns how many there were
    /// (this one included). The count lives `ttl` (the sinks stream's max
    /// age) after the last attempt: `<p>:{<t>}:sink:<stream>:<seq>`.
    pub async fn sink_attempt(
        &self,
        tenant: &str,
        stream: &str,
        stream_sequence: u64,
        ttl: Duration,
    ) -> Result<u64, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(COUNT));
        let mut count = SCRIPT.prepare_invoke();
        count
            .key(format!(
                "{}:{{{tenant}}}:sink:{stream}:{stream_sequence}",
                self.prefix
            ))
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        let count = &count;
        self.run("sink_attempt", |mut conn| async move {
            count.invoke_async(&mut conn).await
        })
        .await
    }
}
