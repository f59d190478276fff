//! Direct delivery: requests to a tool's services-API endpoint, answered
//! in the request's reply. No redelivery here: a failure JetStream would
//! retry is the caller's error result at once.

use std::sync::Arc;

use async_nats::service::endpoint::Endpoint;
use async_nats::service::{Request, error::Error as ServiceError};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::job::process;
use super::outcome::{Outcome, Processed};
use super::reply::{fit_result, write_ledger};
use super::results::encode_result;
use super::shared::Shared;
use crate::builder::Served;
use crate::service_stats::Via;

/// Takes requests from `endpoint` until `shutdown`, each on a task of its
/// own under one of the worker's `permits`.
pub(super) async fn direct_loop(
    mut endpoint: Endpoint,
    tool: Arc<Served>,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = endpoint.next() => match r { Some(r) => r, None => break },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let (tool, shared) = (tool.clone(), shared.clone());
        tracker.spawn(async move {
            answer_request(request, &tool, &shared).await;
            drop(permit);
        });
    }
    let _ = endpoint.stop().await;
}

/// Processes one request and responds to it; then, as for a JetStream
/// job, writes the result to the ledger when the tool ran for it.
async fn answer_request(request: Request, tool: &Served, shared: &Shared) {
    let no_headers = async_nats::HeaderMap::new();
    let headers = request.message.headers.as_ref().unwrap_or(&no_headers);
    let processed = process(
        headers,
        &request.message.payload,
        1,
        None,
        Via::Direct,
        tool,
        shared,
    )
    .await;
    let mut to_record = None;
    let response = match processed {
        Processed::Call(call, Outcome::Answer { result, ran }) => {
            let json = encode_result(&result);
            let response = Ok(fit_result(shared, &result, Some(&json)));
            if ran && !tool.definition().idempotent {
                to_record = Some((call, json));
            }
            response
        }
        Processed::Call(call, Outcome::Retry(failure) | Outcome::Dead(failure)) => {
            Ok(fit_result(shared, &failure.result_for(&call, 1), None))
        }
        // No call context to answer in: the service error says why.
        Processed::Unanswerable(failure) => Err(ServiceError {
            status: format!("{}: {}", failure.code, failure.message),
            code: 400,
        }),
    };
    // As for a JetStream job: the caller first, then the ledger.
    let recording = to_record
        .as_ref()
        .map(|(call, json)| shared.recording.start(call, json.clone()));
    let _ = request.respond(response).await;
    if let Some((call, json)) = &to_record {
        write_ledger(shared, call, json).await;
    }
    drop(recording);
}
