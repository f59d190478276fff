//! [`LiveCatalog`]: the orchestrator's view of the fleet's tools.
//!
//! One [`Catalog`] value (definitions from the workers' catalog bucket,
//! liveness from their services-API `INFO` answers, see
//! [`toolfleet_protocol::catalog::discover`]) held in a `watch` channel and
//! swapped whole on every successful reading, changed or not: a reader
//! takes a snapshot with [`current`](LiveCatalog::current), and a wait for
//! tool results [`subscribe`](LiveCatalog::subscribe)s to count readings.
//!
//! Readings happen every `catalog_refresh` ([`run`](LiveCatalog::run)) and
//! on a miss: a tool that is not in the snapshot gets one fresh reading
//! before it is declared gone or unknown ([`is_live`](LiveCatalog::is_live),
//! [`by_function_name`](LiveCatalog::by_function_name)), since a worker may
//! have started since the last one. One reading runs at a time;
//! a miss that waited for another reading uses that one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::Subjects;
use toolfleet_protocol::catalog::{Catalog, discover};
use toolfleet_protocol::tools::CompiledTool;
use tracing::warn;

/// The live catalog: one value, swapped whole.
pub struct LiveCatalog {
    client: async_nats::Client,
    subjects: Subjects,
    /// How long a reading collects `INFO` answers.
    wait: Duration,
    tx: watch::Sender<Arc<Catalog>>,
    /// Held while a reading runs.
    reading: Mutex<()>,
}

impl LiveCatalog {
    /// An empty catalog (no reading yet).
    pub fn new(client: async_nats::Client, subjects: Subjects, wait: Duration) -> Self {
        Self {
            client,
            subjects,
            wait,
            tx: watch::Sender::new(Arc::new(Catalog::default())),
            reading: Mutex::new(()),
        }
    }

    /// The latest reading.
    pub fn current(&self) -> Arc<Catalog> {
        self.tx.borrow().clone()
    }

    /// A receiver that is told of every reading after this call.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Catalog>> {
        self.tx.subscribe()
    }

    /// Takes one reading now and publishes it. A failed reading is logged
    /// and leaves the catalog as it was.
    pub async fn refresh(&self) {
        let _one = self.reading.lock().await;
        self.read().await;
    }

    /// Is `tool_id` served by a live worker? A miss takes one reading
    /// newer than the snapshot that missed before answering no.
    pub async fn is_live(&self, tool_id: &str) -> bool {
        self.find(|c| c.is_live(tool_id).then_some(()))
            .await
            .is_some()
    }

    /// The live tool a model calls by `function_name`, with the same one
    /// fresh reading on a miss as [`is_live`](Self::is_live).
    pub async fn by_function_name(&self, function_name: &str) -> Option<Arc<CompiledTool>> {
        self.find(|c| c.by_function_name(function_name).map(|e| e.tool.clone()))
            .await
    }

    /// `look` in the snapshot; on a miss, in a reading newer than it.
    async fn find<T>(&self, look: impl Fn(&Catalog) -> Option<T>) -> Option<T> {
        let seen = self.current();
        if let Some(found) = look(&seen) {
            return Some(found);
        }
        {
            let _one = self.reading.lock().await;
            // Another reading finished while this one waited: use it.
            if self.current().readings == seen.readings {
                self.read().await;
            }
        }
        look(&self.current())
    }

    /// Reads the catalog every `every` until `shutdown`.
    pub async fn run(&self, every: Duration, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(every) => self.refresh().await,
            }
        }
    }

    /// One reading; the caller holds `reading`.
    async fn read(&self) {
        let previous = self.current();
        match discover(&self.client, &self.subjects, self.wait, &previous).await {
            Ok(catalog) => {
                self.tx.send_replace(Arc::new(catalog));
            }
            Err(e) => warn!(error = %e, "cannot read the worker catalog"),
        }
    }
}
