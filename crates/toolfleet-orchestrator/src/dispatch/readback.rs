//! Answers a call gets besides its reply.
//!
//! A worker publishes a result on core NATS, then writes it to the result
//! ledger (for a tool that is not idempotent), then acks the job. A reply
//! sent while this orchestrator's connection was away (a NATS restart, a
//! network cut, a slow-consumer drop) is gone: core NATS keeps nothing for
//! an absent subscriber. So the orchestrator reads results back instead of
//! waiting for a reply that will not come:
//!
//! - after its connection comes back, every waiting call of a tool that
//!   keeps a ledger is read from the ledger — at once and then every
//!   [`LOOK_EVERY`] until answered (the worker writes its ledger after it
//!   publishes, so the first look can be early) — and every waiting call
//!   of an idempotent tool (which keeps no ledger) is asked again under a
//!   fresh message id: the first answer wins;
//! - a call whose job JetStream reports as a duplicate is a job already
//!   out under the same call id (an earlier run of the same invocation,
//!   replayed after a takeover or a crash): it is adopted the same way,
//!   never run a second time;
//! - before a call of a ledger-keeping tool is answered `timeout`, the
//!   ledger is read once more.
//!
//! Why the ledger rather than results on a stream: the ledger is written
//! anyway for every call that must not run twice, so reading it back costs
//! nothing until a connection is lost; a results stream would put a
//! JetStream write (and its replication) on every call's reply path.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishAckFuture;
use bytes::Bytes;
use toolfleet_protocol::CallContext;
use toolfleet_protocol::tools::Delivery;
use toolfleet_store::InvocationKey;
use tracing::{debug, warn};

use super::{Batch, Pending, ToolRunner};
use crate::{Events, Invocation};

/// How often waiting calls are read back once their replies may have been
/// lost.
pub(super) const LOOK_EVERY: Duration = Duration::from_secs(1);

/// An idempotent tool's job as it went out, to be asked again.
pub(super) struct Again {
    delivery: Delivery,
    call: CallContext,
    body: Bytes,
}

impl Again {
    pub(super) fn new(delivery: Delivery, call: CallContext, body: Bytes) -> Self {
        Self {
            delivery,
            call,
            body,
        }
    }

    /// The job's headers for another asking: the same call, under a
    /// message id of its own — random, so no earlier asking, of this run
    /// or of an earlier run of the invocation, makes JetStream drop it as
    /// a duplicate — and not marked new (the worker reads the tombstone).
    fn headers(&self) -> HeaderMap {
        let mut call = self.call.clone();
        call.new_call = false;
        let mut headers = call.to_headers();
        headers.insert(
            toolfleet_protocol::headers::NATS_MSG_ID,
            format!("{}.again.{}", call.msg_id(), uuid::Uuid::new_v4().simple()).as_str(),
        );
        headers
    }
}

impl ToolRunner<'_> {
    /// The connection came back: every waiting call's reply may be lost.
    pub(super) async fn after_reconnect(&self, batch: &mut Batch<'_>) {
        debug!(
            waiting = batch.pending.len(),
            "connection back: reading back the waiting calls"
        );
        let mut acks = Vec::new();
        for p in batch.pending.values_mut() {
            acks.extend(self.adopt(p).await);
        }
        // Every job out first, then their acks together.
        for ack in acks {
            if let Err(e) = ack.await {
                warn!(error = %e, "a call asked again was not stored");
            }
        }
        if batch.pending.values().any(|p| p.look) {
            batch.look_at = Some(tokio::time::Instant::now());
        }
    }

    /// Makes `p` answerable without its first reply: read back from the
    /// ledger, or (idempotent) asked again — the job published, its
    /// storage (when it goes through JetStream) for the caller to await.
    pub(super) async fn adopt(&self, p: &mut Pending) -> Option<PublishAckFuture> {
        if p.ledger {
            p.look = true;
            return None;
        }
        let again = p.again.as_ref()?;
        match self
            .publish(
                again.delivery,
                &again.call,
                again.headers(),
                again.body.clone(),
            )
            .await
        {
            Ok(ack) => ack,
            Err(e) => {
                warn!(call_id = %again.call.call_id, error = %e, "a call could not be asked again");
                None
            }
        }
    }

    /// Reads the ledger for the pending calls `which` picks and takes
    /// every result found as its call's answer. A store that cannot answer
    /// changes nothing (the next look, or the deadline, tries again).
    pub(super) async fn read_back(
        &mut self,
        inv: &Invocation,
        batch: &mut Batch<'_>,
        events: &Events,
        which: impl Fn(&Pending) -> bool,
    ) {
        let ids: Vec<String> = batch
            .pending
            .iter()
            .filter(|(_, p)| which(p))
            .map(|(id, _)| id.clone())
            .collect();
        if ids.is_empty() {
            return;
        }
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let key = InvocationKey::new(inv.job.tenant(), &inv.ctx.invocation_id);
        let found = match self.fleet.store.ledger_get_many(key, &refs).await {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %e, "cannot read waiting calls back from the ledger");
                return;
            }
        };
        for result in found.into_iter().flatten() {
            let call_id = result.call_id.clone();
            if self.take_result(&inv.ctx.invocation_id, batch, result, events) {
                debug!(call_id = %call_id, "a call's result was read back from the ledger");
                self.fleet.metrics.results_read_back.inc();
            } else if let Some(p) = batch.pending.get_mut(&call_id) {
                // Another tool's result under this call id (its version
                // changed between runs): not ours, and not read again;
                // the call waits for its own reply or its deadline.
                p.look = false;
            }
        }
    }
}
