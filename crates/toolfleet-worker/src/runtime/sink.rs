//! [`LiveSink`]: where a running call's citations and blobs go (Redis)
//! and its progress messages (the caller's reply subject).

use futures::FutureExt;
use futures::future::BoxFuture;
use toolfleet_protocol::{CallContext, Reference, ToolReply, encode};
use toolfleet_store::{CitationStore, InvocationKey, NewReference};

use crate::ctx::Sink;
use crate::error::ToolError;
use crate::metrics::WorkerMetrics;

/// Citations and blobs to Redis, progress to the caller's reply subject.
pub(super) struct LiveSink {
    pub(super) client: async_nats::Client,
    pub(super) store: CitationStore,
    pub(super) metrics: WorkerMetrics,
}

impl Sink for LiveSink {
    fn shared_store(&self) -> Option<CitationStore> {
        Some(self.store.clone())
    }

    fn cite<'a>(
        &'a self,
        call: &'a CallContext,
        reservation: String,
        refs: Vec<NewReference>,
    ) -> BoxFuture<'a, Result<Vec<Reference>, ToolError>> {
        async move {
            let tool = call.tool_id.to_string();
            let stored = self
                .store
                .reserve(
                    InvocationKey::of_call(call),
                    &reservation,
                    &call.call_id,
                    &tool,
                    refs,
                    call.citation_floor,
                )
                .await
                .map_err(|e| ToolError::transient(e.to_string()))?;
            self.metrics
                .citations_written
                .with_label_values(&[tool.as_str()])
                .inc_by(stored.len() as u64);
            Ok(stored)
        }
        .boxed()
    }

    fn store_blob<'a>(
        &'a self,
        call: &'a CallContext,
        blob_id: String,
        content_type: String,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), ToolError>> {
        async move {
            self.store
                .put_blob(
                    InvocationKey::of_call(call),
                    &blob_id,
                    &content_type,
                    &bytes,
                )
                .await
                .map_err(|e| match e.kind() {
                    // Refused before it was sent: another attempt would
                    // be refused too.
                    toolfleet_store::ErrorKind::TooLarge | toolfleet_store::ErrorKind::Invalid => {
                        ToolError::failed(e.to_string())
                    }
                    _ => ToolError::transient(e.to_string()),
                })
        }
        .boxed()
    }

    fn progress<'a>(&'a self, call: &'a CallContext, message: String) -> BoxFuture<'a, ()> {
        async move {
            let reply = ToolReply::Progress {
                invocation_id: call.invocation.invocation_id.clone(),
                call_id: call.call_id.clone(),
                message,
            };
            let _ = self
                .client
                .publish(call.reply_to.clone(), encode(&reply))
                .await;
        }
        .boxed()
    }
}
