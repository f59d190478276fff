//! The result ledger from the worker's side: results written to Redis in
//! batches ([`LedgerWriter`]), and the results on their way there kept in
//! memory ([`Recording`]) so a repeat of a call that arrives before its
//! write is done is answered, not run again.

use std::collections::HashMap;
use std::sync::Mutex;

use toolfleet_protocol::{CallContext, ToolResult};
use toolfleet_store::{CitationStore, InvocationKey};

/// An invocation as the recording knows it: (tenant, invocation id), since
/// ids are unique per tenant only.
type Invocation = (String, String);

/// The invocation `call` belongs to.
fn invocation_of(call: &CallContext) -> Invocation {
    (
        call.invocation.tenant().to_string(),
        call.invocation.invocation_id.clone(),
    )
}

/// The results this worker has published and is writing to the ledger,
/// by tenant, invocation and call: a repeat of the call that arrives
/// before the write is done is answered from here, so the reply going out
/// before the ledger write never lets this worker run a call twice.
#[derive(Default)]
pub(super) struct Recording {
    results: Mutex<HashMap<Invocation, HashMap<String, bytes::Bytes>>>,
}

impl Recording {
    /// Remembers `json` (the encoded result of `call`) until the guard is
    /// dropped.
    pub(super) fn start<'a>(
        &'a self,
        call: &'a CallContext,
        json: bytes::Bytes,
    ) -> RecordingGuard<'a> {
        if let Ok(mut results) = self.results.lock() {
            results
                .entry(invocation_of(call))
                .or_default()
                .insert(call.call_id.clone(), json);
        }
        RecordingGuard {
            recording: self,
            call,
        }
    }

    /// The result of `call` being written to the ledger, if any.
    pub(super) fn get(&self, call: &CallContext) -> Option<ToolResult> {
        let json = self
            .results
            .lock()
            .ok()?
            .get(&invocation_of(call))?
            .get(&call.call_id)?
            .clone();
        serde_json::from_slice(&json).ok()
    }
}

/// Forgets a recorded result when dropped (its ledger write is done).
pub(super) struct RecordingGuard<'a> {
    recording: &'a Recording,
    call: &'a CallContext,
}

impl Drop for RecordingGuard<'_> {
    fn drop(&mut self) {
        let invocation = invocation_of(self.call);
        if let Ok(mut results) = self.recording.results.lock()
            && let Some(calls) = results.get_mut(&invocation)
        {
            calls.remove(&self.call.call_id);
            if calls.is_empty() {
                results.remove(&invocation);
            }
        }
    }
}

/// The most results one ledger write carries.
const LEDGER_BATCH: usize = 256;

/// The most bytes of results one ledger write carries.
const LEDGER_BATCH_BYTES: usize = 1024 * 1024;

/// One result on its way to the ledger, and who waits for it.
struct LedgerWrite {
    tenant: String,
    invocation_id: String,
    call_id: String,
    json: bytes::Bytes,
    done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

/// Writes results to the ledger in batches: whatever is waiting when the
/// previous write returns goes in the next (one Redis pipeline on a single
/// server), so under load the ledger costs one round trip per batch, not
/// per job; alone, a write goes at once. Each job still waits for (and
/// acks after) the write that carries its result.
pub(super) struct LedgerWriter {
    tx: tokio::sync::mpsc::UnboundedSender<LedgerWrite>,
}

impl LedgerWriter {
    /// Starts the writer task; it ends once the writer is dropped and
    /// every write sent has been carried out.
    pub(super) fn start(store: CitationStore) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<LedgerWrite>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(LEDGER_BATCH);
            while rx.recv_many(&mut batch, LEDGER_BATCH).await > 0 {
                write_batch(&store, &mut batch).await;
            }
        });
        Self { tx }
    }

    /// Writes `json`, the encoded result of `call`; returns once it is
    /// stored, or why it could not be.
    pub(super) async fn write(&self, call: &CallContext, json: bytes::Bytes) -> Result<(), String> {
        let (done, stored) = tokio::sync::oneshot::channel();
        self.tx
            .send(LedgerWrite {
                tenant: call.invocation.tenant().to_string(),
                invocation_id: call.invocation.invocation_id.clone(),
                call_id: call.call_id.clone(),
                json,
                done,
            })
            .map_err(|_| closed())?;
        stored.await.map_err(|_| closed())?
    }
}

/// Writes (and empties) `batch` in pipelines of at most
/// [`LEDGER_BATCH_BYTES`] (one result larger than that goes alone), and
/// tells each write's waiter how its pipeline went.
async fn write_batch(store: &CitationStore, batch: &mut Vec<LedgerWrite>) {
    let mut pending = batch.drain(..).peekable();
    while pending.peek().is_some() {
        let (mut chunk, mut bytes) = (Vec::new(), 0);
        while let Some(write) =
            pending.next_if(|w| chunk.is_empty() || bytes + w.json.len() <= LEDGER_BATCH_BYTES)
        {
            bytes += write.json.len();
            chunk.push(write);
        }
        let results: Vec<(InvocationKey<'_>, &str, &[u8])> = chunk
            .iter()
            .map(|w| {
                let inv = InvocationKey::new(&w.tenant, &w.invocation_id);
                (inv, w.call_id.as_str(), &w.json[..])
            })
            .collect();
        let outcome = store
            .ledger_put_many(&results)
            .await
            .map_err(|e| e.to_string());
        drop(results);
        for write in chunk {
            let _ = write.done.send(outcome.clone());
        }
    }
}

fn closed() -> String {
    "the ledger writer has stopped".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::results::tests::call;
    use crate::runtime::results::{encode_result, error_result};

    #[test]
    fn a_result_being_recorded_is_found_until_its_write_is_done() {
        let recording = Recording::default();
        let first = call("inv-1", "c1");
        let result = error_result(&first, 1, 0, "x", "y");
        let guard = recording.start(&first, encode_result(&result));
        assert_eq!(recording.get(&call("inv-1", "c1")), Some(result));
        assert_eq!(recording.get(&call("inv-1", "c2")), None);
        assert_eq!(recording.get(&call("inv-2", "c1")), None);
        // The same id under another tenant is another invocation.
        let mut elsewhere = call("inv-1", "c1");
        elsewhere.invocation.tenant = Some("globex".into());
        assert_eq!(recording.get(&elsewhere), None);
        drop(guard);
        assert_eq!(recording.get(&first), None);
        assert!(recording.results.lock().unwrap().is_empty());
    }
}
