//! What the server keeps across requests: the script it plays, every
//! request it received ([`Received`]), how often each step's fault has hit,
//! and how its streamed bodies ended ([`StreamStats`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{HeaderMap, Uri};
use serde_json::Value;
use tokio::sync::watch;

use crate::fault::Fault;
use crate::script::{Script, StepKey};

/// Requests kept for [`ScriptedServer::received`](crate::ScriptedServer::received);
/// the oldest go first, so a long-running demo server does not grow
/// without bound.
const MAX_RECORDED_REQUESTS: usize = 1000;

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// When the handler started on it: gaps between these show how long a
    /// client waited before retrying.
    pub at: Instant,
    /// `/v1/chat/completions` or `/v1/responses`.
    pub path: String,
    /// The raw query string, if any (e.g. `api-version=..`).
    pub query: Option<String>,
    /// Every request header, names lower-case.
    pub headers: Vec<(String, String)>,
    /// The body; one that was not JSON appears as a JSON string.
    pub body: Value,
    /// The fault injected into the answer (`status`, `cutMidToolCall`,
    /// `cutMidText`, `malformedChunk`, `slowFirstToken`, `length`).
    pub fault: Option<&'static str>,
}

impl Received {
    /// A request received now, before its body is read: `body` is what is
    /// known of it so far.
    pub(crate) fn new(uri: &Uri, headers: &HeaderMap, body: Value) -> Self {
        Self {
            at: Instant::now(),
            path: uri.path().to_owned(),
            query: uri.query().map(str::to_owned),
            headers: headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_owned(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body,
            fault: None,
        }
    }

    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How the response bodies the server streamed have ended so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bodies that began.
    pub started: u64,
    /// Bodies sent to the end.
    pub completed: u64,
    /// Bodies cut on purpose by a `cutMidToolCall` / `cutMidText` fault.
    pub cut: u64,
    /// Bodies abandoned before their end because the client went away (or
    /// the server shut down): the way a cancelled client shows up here.
    pub dropped: u64,
}

/// Shared by every handler of one server.
pub(crate) struct ServerState {
    pub(crate) script: Script,
    pub(crate) received: Mutex<VecDeque<Received>>,
    /// Fault hits per step, for `times`.
    fault_counts: Mutex<HashMap<StepKey, u32>>,
    pub(crate) fault_hits: AtomicU64,
    pub(crate) streams: watch::Sender<StreamStats>,
    /// TCP connections accepted.
    pub(crate) connections: AtomicU64,
}

impl ServerState {
    pub(crate) fn new(script: Script) -> Self {
        Self {
            script,
            received: Mutex::new(VecDeque::new()),
            fault_counts: Mutex::new(HashMap::new()),
            fault_hits: AtomicU64::new(0),
            streams: watch::Sender::new(StreamStats::default()),
            connections: AtomicU64::new(0),
        }
    }

    pub(crate) fn record(&self, received: Received) {
        // A panic elsewhere while holding the lock leaves a usable log.
        let mut log = self.received.lock().unwrap_or_else(PoisonError::into_inner);
        if log.len() == MAX_RECORDED_REQUESTS {
            log.pop_front();
        }
        log.push_back(received);
    }

    /// Records a request to an endpoint that reads its body leniently
    /// (images, embeddings) and returns the body: its JSON, or `null` when
    /// it is not JSON.
    pub(crate) fn record_lenient(&self, uri: &Uri, headers: &HeaderMap, body: &Bytes) -> Value {
        let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        self.record(Received::new(uri, headers, request.clone()));
        request
    }

    /// Whether this request gets the step's fault, counting it if so.
    pub(crate) fn take_fault(&self, key: StepKey, fault: &Fault) -> bool {
        let mut counts = self
            .fault_counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let hits = counts.entry(key).or_insert(0);
        if fault.times.is_some_and(|times| *hits >= times) {
            return false;
        }
        *hits += 1;
        self.fault_hits.fetch_add(1, Ordering::Relaxed);
        true
    }
}
