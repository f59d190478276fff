//! Bounded waits for tests: every await in a test has a deadline, so a
//! message that never comes fails the test instead of hanging it.

use std::time::Duration;

use futures::StreamExt;

/// Every await in a test is bounded by this.
pub const WAIT: Duration = Duration::from_secs(30);

/// The next message on `sub`, parsed as JSON; panics when none comes
/// within [`WAIT`] or the subscription closes.
pub async fn next_json(sub: &mut async_nats::Subscriber) -> serde_json::Value {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .expect("no message in time")
        .expect("subscription closed");
    serde_json::from_slice(&msg.payload).expect("the message is JSON")
}
