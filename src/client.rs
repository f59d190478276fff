//! Submitting chat jobs and following their events: what `toolfleet chat`
//! and the demo use, and the model for a client in any language
//! (subscribe to the events subject, then publish the job).

use std::time::Duration;

use futures::StreamExt;

use crate::llm::Usage;
use crate::protocol::{
    ChatEvent, ChatEventBody, ChatJob, Envelope, Reference, Subjects, encode, headers,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("NATS: {0}")]
    Nats(String),
    #[error("the fleet did not accept the job: {0}")]
    Rejected(String),
    #[error("no terminal event within {0:?} (is an orchestrator running?)")]
    Timeout(Duration),
    #[error("{code}: {message}")]
    Failed { code: String, message: String },
}

impl ClientError {
    pub fn code(&self) -> &str {
        match self {
            ClientError::Nats(_) => "nats",
            ClientError::Rejected(_) => "rejected",
            ClientError::Timeout(_) => "timeout",
            ClientError::Failed { code, .. } => code,
        }
    }
}

/// The answer of a completed invocation.
#[derive(Debug, Clone)]
pub struct ChatOutcome {
    pub text: String,
    pub references: Vec<Reference>,
    pub usage: Usage,
    pub cost_usd: Option<f64>,
    pub llm_calls: Vec<crate::protocol::LlmCall>,
    pub rounds: u32,
    /// Every event received, in order.
    pub events: Vec<ChatEvent>,
}

/// Submits `job` and waits for its terminal event, calling `on_event` for
/// every event on the way.
pub async fn chat(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
    timeout: Duration,
    mut on_event: impl FnMut(&ChatEvent),
) -> Result<ChatOutcome, ClientError> {
    let mut sub = client
        .subscribe(subjects.chat_events(&job.invocation_id))
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    // The subscription must be registered before the job can produce events.
    client
        .flush()
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    submit(client, subjects, job).await?;

    let deadline = tokio::time::Instant::now() + timeout;
    let mut events = Vec::new();
    loop {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => return Err(ClientError::Nats("event subscription closed".into())),
            Err(_) => return Err(ClientError::Timeout(timeout)),
        };
        let event: ChatEvent = match Envelope::ChatEvent.decode(&msg.payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "malformed chat event ignored");
                continue;
            }
        };
        on_event(&event);
        let body = event.body.clone();
        events.push(event);
        match body {
            ChatEventBody::Completed {
                text,
                references,
                usage,
                cost_usd,
                llm_calls,
                rounds,
            } => {
                return Ok(ChatOutcome {
                    text,
                    references,
                    usage,
                    cost_usd,
                    llm_calls,
                    rounds,
                    events,
                });
            }
            ChatEventBody::Error { code, message } => {
                return Err(ClientError::Failed { code, message });
            }
            _ => {}
        }
    }
}

/// Publishes a chat job to the JetStream stream and waits for it to be
/// stored. `Nats-Msg-Id` is the invocation id, so a retried submit is a
/// no-op inside the stream's duplicate window.
pub async fn submit(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
) -> Result<(), ClientError> {
    let js = async_nats::jetstream::new(client.clone());
    let mut h = async_nats::HeaderMap::new();
    h.insert(headers::NATS_MSG_ID, job.invocation_id.as_str());
    h.insert(headers::INVOCATION_ID, job.invocation_id.as_str());
    js.publish_with_headers(subjects.chat_submit(), h, encode(job))
        .await
        .map_err(|e| ClientError::Rejected(e.to_string()))?
        .await
        .map_err(|e| ClientError::Rejected(e.to_string()))?;
    Ok(())
}

/// A new invocation id.
pub fn new_invocation_id() -> String {
    format!("inv-{}", uuid::Uuid::new_v4().simple())
}

/// A chat job with one user message.
pub fn question(text: &str) -> ChatJob {
    ChatJob {
        invocation_id: new_invocation_id(),
        messages: vec![crate::protocol::ChatMessage {
            role: crate::protocol::ChatRole::User,
            content: text.to_string(),
        }],
        profile: None,
        tenant: None,
        user: None,
        provider: None,
        connection: None,
        resource: None,
        data_source_id: None,
        attached_documents: Vec::new(),
        provider_confidence: None,
        timeout_ms: None,
        traceparent: None,
    }
}
