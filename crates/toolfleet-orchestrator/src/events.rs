//! [`Events`]: one invocation's event publisher.
//!
//! Stages send event bodies without waiting; one task per invocation
//! numbers them (`seq` 0, 1, 2, …) and publishes them in the order they
//! were sent, so a client can detect a gap. An event too big for the NATS
//! server is made smaller rather than lost: a tool call's arguments are
//! replaced by their size, and a terminal event too big becomes an
//! `answer_too_large` error (a lost terminal event would leave the client
//! waiting). For the same reason the terminal event goes through
//! JetStream: the events stream (`<P>_EVENTS`) keeps each invocation's
//! latest event, and the publish waits for the stream to confirm it
//! (tried again across a reconnection), so a client that missed it live
//! reads it there. The publish is tried for [`TERMINAL_PATIENCE`] —
//! longer than a cluster node's loss stalls the stream (4–10 s measured) —
//! and a terminal event the stream still has not stored is said so
//! ([`Terminal::stored`]): its run leaves its chat job unacked, and the
//! redelivery publishes it again from the store. A terminal event that
//! went out while the NATS connection broke is also published again,
//! verbatim (same `seq`), for the clients following live.

use async_nats::jetstream::context::PublishErrorKind;
use serde_json::Value;
use tokio::sync::mpsc;
use toolfleet_protocol::{ChatEvent, ChatEventBody, encode};
use tracing::warn;

use crate::failure::ChatErrorCode;
use crate::tools::ToolOutcome;
use crate::{Failure, Fleet, Invocation};

/// How long the end of an invocation waits for the server to confirm its
/// events.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// An invocation's terminal event as published.
pub(crate) struct Terminal {
    pub(crate) payload: bytes::Bytes,
    /// The events stream confirmed it.
    pub(crate) stored: bool,
}

/// Publishes one invocation's events in order, numbering them.
pub struct Events {
    /// Boxed: the channel allocates a block of slots up front, and an
    /// invocation waiting on its model should not hold 32 whole events.
    tx: mpsc::UnboundedSender<Box<ChatEventBody>>,
    /// The `seq` the next event sent gets (the task numbers events in the
    /// order they are sent).
    next_seq: std::sync::atomic::AtomicU64,
    task: tokio::task::JoinHandle<Option<Terminal>>,
    /// Where the routed events also go, once [`route`](Self::route)d.
    route: std::sync::Arc<std::sync::OnceLock<crate::sinks::Route>>,
    /// A `tool_call` event was sent: the run dispatched a tool (an
    /// idempotency key's failed first job then keeps its key).
    called_tools: std::sync::atomic::AtomicBool,
}

impl Events {
    /// Starts the publishing task for the events of invocation
    /// `invocation_id` of `tenant`: every event on its events subject, and
    /// every one but the deltas on its history subject too (what
    /// `toolfleet events` replays).
    pub(crate) fn start(
        client: async_nats::Client,
        subjects: &toolfleet_protocol::Subjects,
        tenant: &str,
        invocation_id: &str,
    ) -> Self {
        Self::start_at(client, subjects, tenant, invocation_id, 0)
    }

    /// [`start`](Self::start), numbering from `first_seq` (a parked
    /// invocation's events go on where they stopped).
    pub(crate) fn start_at(
        client: async_nats::Client,
        subjects: &toolfleet_protocol::Subjects,
        tenant: &str,
        invocation_id: &str,
        first_seq: u64,
    ) -> Self {
        let subject = subjects.chat_events(tenant, invocation_id);
        let history = subjects.chat_history(tenant, invocation_id);
        let sink = subjects.sink(tenant, invocation_id);
        let invocation_id = invocation_id.to_string();
        let (tx, mut rx) = mpsc::unbounded_channel::<Box<ChatEventBody>>();
        let route = std::sync::Arc::new(std::sync::OnceLock::<crate::sinks::Route>::new());
        let routed = route.clone();
        let task = tokio::spawn(async move {
            let connects = || {
                client
                    .statistics()
                    .connects
                    .load(std::sync::atomic::Ordering::Relaxed)
            };
            let connected = connects();
            let mut seq = first_seq;
            let mut terminal = None;
            let mut stored = false;
            while let Some(body) = rx.recv().await {
                let body = *body;
                let is_terminal = body.is_terminal();
                let is_delta = matches!(body, ChatEventBody::Delta { .. });
                let event = ChatEvent {
                    invocation_id: invocation_id.clone(),
                    seq,
                    body,
                };
                seq += 1;
                let payload = fit(event, client.max_payload());
                if !is_delta
                    && let Err(e) = Box::pin(client.publish(history.clone(), payload.clone())).await
                {
                    warn!(error = %e, "cannot publish a chat event to the history");
                }
                if let Some(route) = routed.get().filter(|r| !is_delta && r.takes(is_terminal)) {
                    Box::pin(crate::sinks::enqueue(
                        &client,
                        &sink,
                        route,
                        &invocation_id,
                        seq - 1,
                        &payload,
                    ))
                    .await;
                }
                if is_terminal {
                    terminal = Some(payload.clone());
                    // Boxed: the task waits on its channel for the whole
                    // invocation, and should not carry this rare state.
                    stored = Box::pin(publish_terminal(&client, &subject, payload)).await;
                } else if let Err(e) = Box::pin(client.publish(subject.clone(), payload)).await {
                    warn!(error = %e, "cannot publish a chat event");
                }
            }
            Box::pin(flush_out(&client, &subject, terminal.as_ref(), || {
                connects() != connected
            }))
            .await;
            terminal.map(|payload| Terminal { payload, stored })
        });
        Self {
            tx,
            next_seq: std::sync::atomic::AtomicU64::new(first_seq),
            task,
            route,
            called_tools: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Routes the events published from now on to `route`'s sinks as
    /// well (once: a second route is ignored).
    pub(crate) fn route(&self, route: crate::sinks::Route) {
        let _ = self.route.set(route);
    }

    /// Queues an event; it is published after every event sent before it.
    /// Terminal events (`completed`, `error`) are the frame's to send, once:
    /// one sent here is refused and logged, so an [`crate::Orchestrator`]
    /// cannot end an invocation twice.
    pub fn send(&self, body: ChatEventBody) {
        if body.is_terminal() {
            tracing::error!(
                kind = body.name(),
                "an orchestrator tried to send a terminal event itself; it is dropped (return the answer or a Failure instead)"
            );
            return;
        }
        self.queue(body);
    }

    /// Queues the invocation's one terminal event.
    pub(crate) fn finish(&self, body: ChatEventBody) {
        self.queue(body);
    }

    fn queue(&self, body: ChatEventBody) {
        if matches!(body, ChatEventBody::ToolCall { .. }) {
            (self.called_tools).store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if self.tx.send(Box::new(body)).is_ok() {
            self.next_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether the run sent a `tool_call` event (dispatched a tool).
    pub(crate) fn called_tools(&self) -> bool {
        (self.called_tools).load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The `seq` the next event sent will get.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until every event sent so far is published; returns the
    /// terminal event as published, if one was sent.
    pub(crate) async fn close(self) -> Option<bytes::Bytes> {
        self.close_terminal().await.map(|t| t.payload)
    }

    /// [`Events::close`], and whether the events stream stored the
    /// terminal event.
    pub(crate) async fn close_terminal(self) -> Option<Terminal> {
        drop(self.tx);
        self.task.await.ok().flatten()
    }
}

/// Waits (bounded: a flush into a connection that died may wait for a
/// reconnection that takes long) until the events are out. Events written
/// into a connection that then broke are lost with it (core NATS), and a
/// flush on the next connection does not say otherwise; the terminal event
/// must arrive: it is published again, verbatim (same `seq`: a client that
/// has it already sees a repeat it can drop).
async fn flush_out(
    client: &async_nats::Client,
    subject: &str,
    terminal: Option<&bytes::Bytes>,
    reconnected: impl Fn() -> bool,
) {
    let flushed = matches!(
        tokio::time::timeout(FLUSH_WAIT, client.flush()).await,
        Ok(Ok(()))
    );
    if let Some(payload) = terminal
        && (!flushed || reconnected())
    {
        warn!(
            "the connection broke while this invocation's events went out; its terminal event is published again"
        );
        let _ = client.publish(subject.to_string(), payload.clone()).await;
        let _ = tokio::time::timeout(FLUSH_WAIT, client.flush()).await;
    }
}

/// How long the terminal event's publish is tried before its run gives
/// up on it (the chat job is then left unacked: its redelivery publishes
/// it again). Well inside the events stream's two-minute duplicate window,
/// so every try is stored once.
pub(crate) const TERMINAL_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// The longest pause between two tries of the terminal event.
const TERMINAL_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Publishes the terminal event through JetStream and waits for the events
/// stream to store it, trying again (with the same `Nats-Msg-Id`, so it is
/// stored once) for [`TERMINAL_PATIENCE`] when the publish or its
/// confirmation is lost — across a reconnection or a stream leader's
/// election. The id names the events subject, so the tenant too: the same
/// invocation id under another tenant is another invocation, whose
/// terminal event a duplicate window shared by all tenants must not drop.
/// Core subscribers receive it like any event; a retry after a lost
/// confirmation may reach them twice, with the same `seq`. Whether it is
/// done: stored, or there is no events stream to keep it.
pub(crate) async fn publish_terminal(
    client: &async_nats::Client,
    subject: &str,
    payload: bytes::Bytes,
) -> bool {
    let js = async_nats::jetstream::new(client.clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        toolfleet_protocol::headers::NATS_MSG_ID,
        format!("terminal:{subject}").as_str(),
    );
    let until = tokio::time::Instant::now() + TERMINAL_PATIENCE;
    let mut pause = std::time::Duration::from_millis(200);
    loop {
        let stored = match js
            .publish_with_headers(subject.to_string(), headers.clone(), payload.clone())
            .await
        {
            Ok(ack) => ack.await.map(drop),
            Err(e) => Err(e),
        };
        match stored {
            Ok(()) => return true,
            // No events stream (deleted, or a server without JetStream):
            // the event went out live; there is nothing to retry, nor
            // anywhere to keep it.
            Err(e) if matches!(e.kind(), PublishErrorKind::StreamNotFound) => {
                warn!(error = %e, "the events stream did not store the terminal event (is it there?)");
                return true;
            }
            Err(e) if tokio::time::Instant::now() + pause >= until => {
                warn!(error = %e, "the events stream did not confirm the terminal event in time; the chat job is left to be delivered again");
                return false;
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(TERMINAL_BACKOFF_MAX);
            }
        }
    }
}

/// The event's payload, made to fit in `limit` bytes (0: no limit known)
/// where it can be.
fn fit(event: ChatEvent, limit: usize) -> bytes::Bytes {
    let payload = encode(&event);
    if limit == 0 || payload.len() <= limit {
        return payload;
    }
    let size = payload.len();
    let body = match event.body {
        ChatEventBody::ToolCall { call_id, tool, .. } => ChatEventBody::ToolCall {
            call_id,
            tool,
            arguments: Value::String(format!("[{size} bytes: too large for an event]")),
        },
        // The person must still learn which call waits, and where to
        // answer: the arguments go, the rest stays.
        ChatEventBody::ApprovalRequested {
            call_id,
            tool,
            expires_at_ms,
            subject,
            ..
        } => ChatEventBody::ApprovalRequested {
            call_id,
            tool,
            arguments: Value::String(format!("[{size} bytes: too large for an event]")),
            expires_at_ms,
            subject,
        },
        terminal if terminal.is_terminal() => ChatEventBody::Error {
            code: ChatErrorCode::AnswerTooLarge.to_string(),
            message: format!(
                "the answer event is {size} bytes; the NATS server takes at most {limit}"
            ),
            retry_after_ms: None,
        },
        other => {
            warn!(
                event = other.name(),
                size, limit, "a chat event is too large for the NATS server"
            );
            return payload;
        }
    };
    encode(&ChatEvent { body, ..event })
}

impl Fleet {
    /// Takes the references of a turn's tool calls into the invocation and
    /// publishes a `references` event with those not published yet.
    pub fn publish_references(
        &self,
        inv: &mut Invocation,
        outcomes: &[ToolOutcome],
        events: &Events,
    ) -> Result<(), Failure> {
        for outcome in outcomes {
            inv.citations.add(&outcome.references)?;
        }
        let new = inv.citations.unpublished();
        if !new.is_empty() {
            let references = crate::links::resolve_all(new, &self.config().profiles.links);
            events.send(ChatEventBody::References { references });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(body: ChatEventBody) -> ChatEvent {
        ChatEvent {
            invocation_id: "inv-1".into(),
            seq: 7,
            body,
        }
    }

    fn decoded(payload: &[u8]) -> ChatEvent {
        serde_json::from_slice(payload).expect("an event")
    }

    #[test]
    fn events_that_fit_are_published_as_they_are() {
        let e = event(ChatEventBody::Delta { text: "hi".into() });
        assert_eq!(decoded(&fit(e.clone(), 1000)), e);
        assert_eq!(decoded(&fit(e.clone(), 0)), e);
    }

    #[test]
    fn big_tool_call_arguments_are_replaced_by_their_size() {
        let e = event(ChatEventBody::ToolCall {
            call_id: "call_1".into(),
            tool: "system:current_datetime@1.0.0".into(),
            arguments: serde_json::json!({ "utcOffset": "x".repeat(5000) }),
        });
        let out = decoded(&fit(e, 1000));
        assert_eq!(out.seq, 7);
        match out.body {
            ChatEventBody::ToolCall {
                call_id, arguments, ..
            } => {
                assert_eq!(call_id, "call_1");
                assert!(
                    arguments.as_str().is_some_and(|a| a.contains("bytes")),
                    "{arguments}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_big_approval_request_keeps_its_call_and_subject() {
        let e = event(ChatEventBody::ApprovalRequested {
            call_id: "call_1".into(),
            tool: "web:read_page@1.0.0".into(),
            arguments: serde_json::json!({ "url": "x".repeat(5000) }),
            expires_at_ms: 9,
            subject: "toolfleet.chat.approve.acme.inv-1".into(),
        });
        match decoded(&fit(e, 1000)).body {
            ChatEventBody::ApprovalRequested {
                call_id,
                arguments,
                subject,
                ..
            } => {
                assert_eq!(call_id, "call_1");
                assert_eq!(subject, "toolfleet.chat.approve.acme.inv-1");
                assert!(arguments.as_str().is_some_and(|a| a.contains("bytes")));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_terminal_event_too_big_becomes_a_small_error() {
        let e = event(ChatEventBody::Error {
            code: "x".into(),
            message: "y".repeat(5000),
            retry_after_ms: None,
        });
        match decoded(&fit(e, 1000)).body {
            ChatEventBody::Error { code, .. } => assert_eq!(code, "answer_too_large"),
            other => panic!("{other:?}"),
        }
    }
}
