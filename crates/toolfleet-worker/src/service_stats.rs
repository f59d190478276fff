//! What a worker reports in `$SRV.STATS`: every tool job it ran, JetStream
//! deliveries included.
//!
//! The services API counts only the requests an endpoint answered itself
//! (`num_requests`, `num_errors`: direct calls). Most of a fleet's traffic
//! comes through JetStream, so each endpoint's `data` (the services API's
//! place for a service's own figures) carries the whole count:
//!
//! ```json
//! { "jobs": 42, "errors": 3, "jetstream": 40, "direct": 2,
//!   "processing_ms": 1234, "by_status": { "ok": 39, "error": 2, "timeout": 1 },
//!   "last_error": { "code": "timeout", "message": "…", "at_ms": 1764111111000 } }
//! ```
//!
//! `toolfleet status` reads it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// How a job reached the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    JetStream,
    Direct,
}

/// The longest error message kept for `last_error`.
const MAX_MESSAGE_CHARS: usize = 200;

/// One endpoint's (one tool's) counts.
#[derive(Default, Debug)]
pub(crate) struct EndpointJobs {
    jetstream: AtomicU64,
    direct: AtomicU64,
    errors: AtomicU64,
    processing_us: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Default, Debug)]
struct Inner {
    by_status: BTreeMap<String, u64>,
    last_error: Option<Value>,
}

impl EndpointJobs {
    /// Counts one finished delivery: `status` is the result's status
    /// (`ok`, `error`, `timeout`, ...) or `retry` / `dead`; `error` its
    /// code and message when it failed.
    pub(crate) fn record(
        &self,
        via: Via,
        status: &str,
        error: Option<(&str, &str)>,
        took: Duration,
    ) {
        match via {
            Via::JetStream => &self.jetstream,
            Via::Direct => &self.direct,
        }
        .fetch_add(1, Ordering::Relaxed);
        self.processing_us.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if error.is_some() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *inner.by_status.entry(status.to_string()).or_default() += 1;
        if let Some((code, message)) = error {
            let message: String = message.chars().take(MAX_MESSAGE_CHARS).collect();
            inner.last_error = Some(json!({
                "code": code,
                "message": message,
                "at_ms": toolfleet_protocol::now_ms(),
            }));
        }
    }

    fn data(&self) -> Value {
        let jetstream = self.jetstream.load(Ordering::Relaxed);
        let direct = self.direct.load(Ordering::Relaxed);
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        json!({
            "jobs": jetstream + direct,
            "errors": self.errors.load(Ordering::Relaxed),
            "jetstream": jetstream,
            "direct": direct,
            "processing_ms": self.processing_us.load(Ordering::Relaxed) / 1000,
            "by_status": inner.by_status,
            "last_error": inner.last_error,
        })
    }
}

/// Every endpoint's counts, by endpoint name.
#[derive(Default, Debug)]
pub(crate) struct JobStats {
    endpoints: HashMap<String, std::sync::Arc<EndpointJobs>>,
}

impl JobStats {
    /// Counts for these endpoint names.
    pub(crate) fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            endpoints: names
                .into_iter()
                .map(|n| (n.to_string(), std::sync::Arc::default()))
                .collect(),
        }
    }

    /// The counts of endpoint `name`.
    pub(crate) fn endpoint(&self, name: &str) -> std::sync::Arc<EndpointJobs> {
        self.endpoints.get(name).cloned().unwrap_or_default()
    }

    /// The `data` of endpoint `name` for `$SRV.STATS`.
    pub(crate) fn data(&self, name: &str) -> Value {
        self.endpoints.get(name).map_or(Value::Null, |e| e.data())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_delivery_counts_and_the_last_error_is_kept_short() {
        let stats = JobStats::new(["system-clock-1-0-0"]);
        let e = stats.endpoint("system-clock-1-0-0");
        e.record(Via::JetStream, "ok", None, Duration::from_millis(3));
        e.record(Via::Direct, "ok", None, Duration::from_millis(2));
        let long = "x".repeat(500);
        e.record(
            Via::JetStream,
            "timeout",
            Some(("timeout", &long)),
            Duration::from_millis(5),
        );
        let data = stats.data("system-clock-1-0-0");
        assert_eq!(data["jobs"], 3);
        assert_eq!(data["jetstream"], 2);
        assert_eq!(data["direct"], 1);
        assert_eq!(data["errors"], 1);
        assert_eq!(data["processing_ms"], 10);
        assert_eq!(data["by_status"], json!({"ok": 2, "timeout": 1}));
        assert_eq!(data["last_error"]["code"], "timeout");
        assert_eq!(
            data["last_error"]["message"].as_str().unwrap().len(),
            MAX_MESSAGE_CHARS
        );
        assert_eq!(stats.data("unknown"), Value::Null);
    }
}
