//! One request's chat job: submitted and followed the way every client of
//! the fleet does it (`toolfleet_protocol::client::chat`: subscribe, submit
//! without a message id, read the stored terminal event after quiet
//! spells), its events folded by [`Answer`] into [`Output`]s.
//!
//! A job the client gives up on is cancelled: dropping a [`Follow`] before
//! its last output (the client disconnected, the request timed out)
//! publishes the invocation's cancel, as `toolfleet_protocol::client`'s own
//! calls do. A job that ended, or that waits for an approval, is left
//! alone.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use toolfleet_protocol::client::ClientError;
use toolfleet_protocol::{ChatEvent, ChatEventBody, ChatJob, Subjects};

use super::answer::{Answer, Collected, Held, Output};
use super::error::ApiError;

/// How long the calls of one turn held for approval have to arrive after
/// the first: the fleet announces them one event each, then parks.
const HELD_TOGETHER: Duration = Duration::from_millis(300);

enum Step {
    Event(ChatEvent),
    Failed(ClientError),
}

/// A submitted job and the way to its events.
pub(crate) struct Follow {
    steps: mpsc::UnboundedReceiver<Step>,
    task: tokio::task::JoinHandle<()>,
    answer: Answer,
    queue: VecDeque<Output>,
    /// Set once the last output was handed out.
    over: bool,
    /// The cancel to publish if the job is given up (taken when it needs
    /// none).
    cancel: Option<(async_nats::Client, String)>,
    timeout: Duration,
    /// Past it the request is given up, whatever NATS does (a flush to a
    /// server that went away waits for its return).
    deadline: tokio::time::Instant,
    pub invocation_id: String,
}

impl Follow {
    /// Submits `job` (its tenant the key's) and follows it for at most
    /// `timeout`.
    pub(crate) fn start(
        client: &async_nats::Client,
        subjects: &Subjects,
        job: ChatJob,
        timeout: Duration,
    ) -> Self {
        let (tx, steps) = mpsc::unbounded_channel();
        let cancel = Some((
            client.clone(),
            subjects.chat_cancel(job.tenant(), &job.invocation_id),
        ));
        let invocation_id = job.invocation_id.clone();
        let (client, subjects) = (client.clone(), subjects.clone());
        let task = tokio::spawn(async move {
            let events = tx.clone();
            let ended = toolfleet_protocol::client::chat(&client, &subjects, &job, timeout, |e| {
                let _ = events.send(Step::Event(e.clone()));
            })
            .await;
            match ended {
                // An `error` event: already passed on as an event.
                Ok(_) | Err(ClientError::Failed { .. }) => {}
                Err(e) => {
                    let _ = tx.send(Step::Failed(e));
                }
            }
        });
        Self {
            steps,
            task,
            answer: Answer::default(),
            queue: VecDeque::new(),
            over: false,
            cancel,
            timeout,
            deadline: tokio::time::Instant::now() + timeout + Duration::from_secs(1),
            invocation_id,
        }
    }

    /// The next output; `None` after the last.
    pub(crate) async fn next(&mut self) -> Option<Output> {
        loop {
            if let Some(out) = self.queue.pop_front() {
                if out.is_last() {
                    self.over = true;
                    self.queue.clear();
                }
                return Some(out);
            }
            if self.over {
                return None;
            }
            let Ok(step) = tokio::time::timeout_at(self.deadline, self.steps.recv()).await else {
                self.queue
                    .push_back(Output::Failed(ApiError::timeout(self.timeout)));
                continue;
            };
            match step {
                Some(Step::Event(e)) => self.on_event(e.body).await,
                Some(Step::Failed(e)) => {
                    // Refused before it was stored: there is nothing to
                    // cancel (a cancel would only be remembered).
                    if matches!(
                        e,
                        ClientError::QueueFull(_) | ClientError::JobTooLarge { .. }
                    ) {
                        self.cancel = None;
                    }
                    self.queue
                        .push_back(Output::Failed(ApiError::from_client(&e, self.timeout)));
                }
                None => self.queue.push_back(Output::Failed(ApiError::unavailable(
                    "The fleet's events stopped before the answer.",
                ))),
            }
        }
    }

    /// Every output, to the last.
    ///
    /// # Errors
    ///
    /// The failure that ended the answer.
    pub(crate) async fn collect(&mut self) -> Result<Collected, ApiError> {
        let mut c = Collected::default();
        while let Some(out) = self.next().await {
            c.add(out)?;
        }
        Ok(c)
    }

    async fn on_event(&mut self, body: ChatEventBody) {
        let terminal = body.is_terminal();
        let outputs = self.answer.on_event(body);
        // The fleet ended the invocation itself: nothing to cancel.
        if terminal {
            self.cancel = None;
        }
        for out in outputs {
            match out {
                Output::Approval(first) => self.gather_held(first).await,
                other => self.queue.push_back(other),
            }
        }
    }

    /// Every call of the turn held with the first: they arrive together,
    /// then the invocation parks (and is not cancelled: it waits for its
    /// approvers).
    async fn gather_held(&mut self, mut held: Vec<Held>) {
        self.cancel = None;
        let mut after = Vec::new();
        while let Ok(Some(Step::Event(e))) =
            tokio::time::timeout(HELD_TOGETHER, self.steps.recv()).await
        {
            for out in self.answer.on_event(e.body) {
                match out {
                    Output::Approval(more) => held.extend(more),
                    other => after.push(other),
                }
            }
        }
        self.queue.push_back(Output::Approval(held));
        self.queue.extend(after);
    }
}

impl Drop for Follow {
    fn drop(&mut self) {
        self.task.abort();
        if let Some((client, subject)) = self.cancel.take() {
            tracing::info!(invocation = %self.invocation_id, "the client gave up: cancelling its job");
            tokio::spawn(async move {
                let _ = client.publish(subject, Bytes::new()).await;
                let _ = client.flush().await;
            });
        }
    }
}
