//! [`Replies`]: one reply subscription per orchestrator.
//!
//! Every run's call inbox is `<p>.reply.<orchestrator>.<run>`, and a call
//! replies on `<inbox>.<call id>`. One wildcard subscription
//! (`<p>.reply.<orchestrator>.*.*`) routes each reply to its run by the
//! `<run>` token, so a waiting invocation holds a map entry and a small
//! channel instead of a NATS subscription of its own (its buffer, a `SUB`
//! and an `UNSUB` per job, and the server's interest entry).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::Subjects;

/// A reply as it travels to its run: boxed, so a run's channel allocates a
/// few hundred bytes up front rather than a block of whole messages.
pub(crate) type Reply = Box<async_nats::Message>;

/// The orchestrator's reply subscription and the runs waiting on it.
pub(crate) struct Replies {
    /// `<p>.reply.<orchestrator>`.
    root: String,
    runs: DashMap<u64, mpsc::UnboundedSender<Reply>>,
    next: AtomicU64,
}

impl Replies {
    /// Subscribes the orchestrator's reply root and routes replies until
    /// `shutdown` or the end of the subscription.
    pub(crate) async fn start(
        client: &async_nats::Client,
        subjects: &Subjects,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, async_nats::SubscribeError> {
        let replies = Arc::new(Self {
            root: subjects.reply_inbox(),
            runs: DashMap::new(),
            next: AtomicU64::new(0),
        });
        let mut sub = client.subscribe(format!("{}.*.*", replies.root)).await?;
        let router = replies.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    msg = sub.next() => match msg {
                        Some(msg) => router.route(msg),
                        None => break,
                    },
                }
            }
            // Waiting runs see their channel close.
            router.runs.clear();
        });
        Ok(replies)
    }

    /// A call inbox for one run; its replies arrive on the returned
    /// [`RunInbox`] until it is dropped.
    pub(crate) fn register(self: &Arc<Self>) -> RunInbox {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.runs.insert(id, tx);
        RunInbox {
            inbox: format!("{}.{id}", self.root),
            id,
            rx,
            replies: self.clone(),
        }
    }

    fn route(&self, msg: async_nats::Message) {
        let run = msg
            .subject
            .as_str()
            .strip_prefix(self.root.as_str())
            .and_then(|rest| rest.strip_prefix('.'))
            .and_then(|rest| rest.split('.').next())
            .and_then(|token| token.parse::<u64>().ok());
        if let Some(tx) = run.and_then(|run| self.runs.get(&run)) {
            let _ = tx.send(Box::new(msg));
        }
    }

    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.runs.len()
    }
}

/// One run's call inbox.
pub(crate) struct RunInbox {
    /// `<p>.reply.<orchestrator>.<run>`: a call replies on
    /// `<inbox>.<call id>`.
    pub(crate) inbox: String,
    id: u64,
    rx: mpsc::UnboundedReceiver<Reply>,
    replies: Arc<Replies>,
}

impl RunInbox {
    /// The next reply; `None` once the orchestrator's subscription ended.
    pub(crate) async fn next(&mut self) -> Option<Reply> {
        self.rx.recv().await
    }
}

impl Drop for RunInbox {
    fn drop(&mut self) {
        self.replies.runs.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(subject: &str) -> async_nats::Message {
        async_nats::Message {
            subject: subject.into(),
            reply: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers: None,
            status: None,
            description: None,
            length: 2,
        }
    }

    #[test]
    fn replies_reach_their_run_only_while_it_waits() {
        let replies = Arc::new(Replies {
            root: "toolfleet.reply.abc".into(),
            runs: DashMap::new(),
            next: AtomicU64::new(0),
        });
        let mut one = replies.register();
        let mut two = replies.register();
        assert_eq!(one.inbox, "toolfleet.reply.abc.0");
        assert_eq!(two.inbox, "toolfleet.reply.abc.1");
        replies.route(message("toolfleet.reply.abc.1.call_x"));
        replies.route(message("toolfleet.reply.abc.0.call_y"));
        // Not ours, or no such run: dropped.
        replies.route(message("toolfleet.reply.other.0.call_z"));
        replies.route(message("toolfleet.reply.abc.9.call_z"));
        replies.route(message("toolfleet.reply.abc.x.call_z"));
        let got = |inbox: &mut RunInbox| {
            futures::FutureExt::now_or_never(inbox.next())
                .flatten()
                .map(|m| m.subject.to_string())
        };
        assert_eq!(
            got(&mut one).as_deref(),
            Some("toolfleet.reply.abc.0.call_y")
        );
        assert_eq!(
            got(&mut two).as_deref(),
            Some("toolfleet.reply.abc.1.call_x")
        );
        assert_eq!(got(&mut one), None);
        assert_eq!(replies.waiting(), 2);
        drop(one);
        assert_eq!(replies.waiting(), 1);
        drop(two);
        assert_eq!(replies.waiting(), 0);
    }
}
