//! Where approvals live: the parked bucket (`<P>_PARKED`, key =
//! `<tenant>.<invocation id>`, so the same id under two tenants never
//! meets; the [`Fleet`] holds it) and the decisions stream
//! (`<P>_DECISIONS`).

use async_nats::jetstream::{self, kv};
use toolfleet_protocol::approval::Decision;
use tracing::warn;

use super::Parked;
use crate::Fleet;

/// The parked bucket, and the decisions stream made sure of: what an
/// orchestrator opens at its start.
pub(crate) async fn open(
    js: &jetstream::Context,
    subjects: &toolfleet_protocol::Subjects,
) -> Result<kv::Store, String> {
    let bucket = toolfleet_protocol::streams::parked_bucket(js, subjects)
        .await
        .map_err(|e| e.to_string())?;
    toolfleet_protocol::streams::ensure_decisions_stream(js, subjects)
        .await
        .map_err(|e| e.to_string())?;
    Ok(bucket)
}

/// Whether the bucket refused a put for its size: JetStream says so only
/// in the words of its error (its code is every store failure's).
fn bucket_full(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.to_string().contains("maximum bytes exceeded") {
            return true;
        }
        next = e.source();
    }
    false
}

/// Why an invocation could not be parked.
pub(crate) enum ParkError {
    /// Its tenant's cap, or the bucket's size: `too_many_parked`.
    Full(String),
    /// The bucket did not answer: `approval_unavailable`.
    Store(String),
}

/// The parked bucket's key of `tenant`'s invocation `invocation_id`
/// (both are single subject tokens: neither holds a `.`).
pub(crate) fn parked_key(tenant: &str, invocation_id: &str) -> String {
    format!("{tenant}.{invocation_id}")
}

impl Fleet {
    /// Keeps `parked` in the bucket (a new record, or the invocation's
    /// earlier one replaced: the run writing it holds the lease). A new
    /// record of a tenant that has its cap of them (`max_parked`), or one
    /// the full bucket refuses, is [`ParkError::Full`].
    pub(crate) async fn keep_parked(&self, parked: &Parked) -> Result<(), ParkError> {
        let tenant = parked.tenant.as_str();
        let key = parked_key(tenant, &parked.job.invocation_id);
        let cap = self.config.profiles.caps_of(tenant).max_parked;
        if self.tenant_store.parked_full(&key, cap) {
            self.metrics
                .caps_refused
                .with_label_values(&[tenant, "parked"])
                .inc();
            return Err(ParkError::Full(format!(
                "a call needs approval, but tenant {tenant:?} already has {cap} invocations \
                 parked for approval, its cap (max_parked); decide some of them first"
            )));
        }
        let value = serde_json::to_vec(parked).map_err(|e| ParkError::Store(e.to_string()))?;
        match self.parked_bucket.put(key, value.into()).await {
            Ok(_) => Ok(()),
            Err(e) if bucket_full(&e) => {
                self.metrics
                    .caps_refused
                    .with_label_values(&[tenant, "parked"])
                    .inc();
                Err(ParkError::Full(
                    "a call needs approval, but the parked bucket is full; decide some parked \
                     invocations first"
                        .to_string(),
                ))
            }
            Err(e) => Err(ParkError::Store(e.to_string())),
        }
    }

    /// Removes the record of an invocation that ended. Best effort: a
    /// record left behind is removed by the next decision or timeout on
    /// it, or by the bucket's age limit.
    pub(crate) async fn forget_parked(&self, tenant: &str, invocation_id: &str) {
        let key = parked_key(tenant, invocation_id);
        if let Err(e) = self.parked_bucket.delete(&key).await {
            warn!(invocation_id, error = %e, "cannot remove the parked record of an ended invocation");
        }
    }

    /// The record of `tenant`'s `invocation_id` and its revision, if it
    /// is parked.
    pub(crate) async fn parked(
        &self,
        tenant: &str,
        invocation_id: &str,
    ) -> Result<Option<(Parked, u64)>, String> {
        let entry = self
            .parked_bucket
            .entry(parked_key(tenant, invocation_id))
            .await
            .map_err(|e| e.to_string())?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let parked: Parked = serde_json::from_slice(&entry.value)
            .map_err(|e| format!("the parked record cannot be read: {e}"))?;
        // The key names the tenant; a record that says otherwise is not
        // this tenant's.
        if parked.tenant != tenant || parked.job.invocation_id != invocation_id {
            return Ok(None);
        }
        Ok(Some((parked, entry.revision)))
    }

    /// Writes a record (`value`, serialised) over revision `revision` of
    /// `tenant`'s `invocation_id` (a compare-and-set: another decision
    /// written in between fails it with `WrongLastRevision`).
    pub(crate) async fn update_parked(
        &self,
        tenant: &str,
        invocation_id: &str,
        value: Vec<u8>,
        revision: u64,
    ) -> Result<u64, kv::UpdateError> {
        self.parked_bucket
            .update(parked_key(tenant, invocation_id), value.into(), revision)
            .await
    }

    /// Publishes `decision` on the decisions stream; returns whether it
    /// was new (not a duplicate of one already recorded).
    pub(crate) async fn record_decision(
        &self,
        tenant: &str,
        decision: &Decision,
    ) -> Result<bool, String> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            toolfleet_protocol::headers::NATS_MSG_ID,
            decision.msg_id().as_str(),
        );
        let ack = self
            .js
            .publish_with_headers(
                self.config.subjects.chat_decision(tenant),
                headers,
                serde_json::to_vec(decision)
                    .map_err(|e| e.to_string())?
                    .into(),
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        Ok(!ack.duplicate)
    }
}
