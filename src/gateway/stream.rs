//! Streaming an answer as server-sent events, whichever API's frames.
//!
//! The status line waits for the job's first output (a tool call, a text
//! piece, the end): a job the fleet refuses at once (rate limited, budget
//! spent, its profile unknown) is answered with its own status and
//! `Retry-After`, as api.openai.com answers a 429 before any stream; after
//! that, a failure is the stream's last frame. While the fleet is quiet a
//! comment line (`: keep-alive`, which SSE clients skip) goes out every few
//! seconds, so proxies keep the connection and a client that went away is
//! noticed. When the client goes away the stream's task ends and drops the
//! [`Follow`], which cancels the job.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

use super::answer::Output;
use super::error::ApiError;
use super::job::Follow;

/// What every frame of one answer shares.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub invocation_id: String,
    /// The model (profile) as the request named it.
    pub model: String,
    /// Unix seconds at the request.
    pub created: u64,
}

/// One API's frames, written from [`Output`]s.
pub(crate) trait Frames: Send + 'static {
    /// What opens the stream, before the first output's frames.
    fn open(&mut self) -> Vec<String>;
    /// The frames of one output.
    fn on(&mut self, out: Output) -> Vec<String>;
}

/// `data: <json>` (Chat Completions).
pub(crate) fn data_frame(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// `event: <type>` and `data: <json>` (the Responses API).
pub(crate) fn event_frame(kind: &str, v: &Value) -> String {
    format!("event: {kind}\ndata: {v}\n\n")
}

/// The response header naming the invocation a request ran as.
pub(crate) const INVOCATION_HEADER: &str = "x-toolfleet-invocation-id";

/// Streams `follow`'s outputs as `frames` once the first is known; an
/// error before that is the whole answer.
pub(crate) async fn respond(
    mut follow: Follow,
    frames: impl Frames,
    keep_alive: Duration,
    tracker: &TaskTracker,
) -> Response {
    let first = match follow.next().await {
        Some(Output::Failed(e)) => return e.into_response(),
        Some(out) => out,
        None => {
            return ApiError::unavailable("The fleet's events stopped before the answer.")
                .into_response();
        }
    };
    let invocation_id = follow.invocation_id.clone();
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tracker.spawn(pump(follow, frames, first, tx, keep_alive));
    let body = Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        [(INVOCATION_HEADER, invocation_id)],
        body,
    )
        .into_response()
}

/// Writes the frames until the last output, or until the client is gone
/// (then dropping `follow` cancels the job).
async fn pump(
    mut follow: Follow,
    mut frames: impl Frames,
    first: Output,
    tx: mpsc::Sender<Bytes>,
    keep_alive: Duration,
) {
    let mut last = first.is_last();
    let mut out = frames.open();
    out.extend(frames.on(first));
    for frame in out {
        if tx.send(Bytes::from(frame)).await.is_err() {
            return;
        }
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keep_alive, keep_alive);
    while !last {
        let frames_out = tokio::select! {
            () = tx.closed() => return,
            _ = tick.tick() => vec![": keep-alive\n\n".to_string()],
            next = follow.next() => match next {
                None => return,
                Some(out) => {
                    last = out.is_last();
                    frames.on(out)
                }
            },
        };
        for frame in frames_out {
            if tx.send(Bytes::from(frame)).await.is_err() {
                return;
            }
        }
    }
}
