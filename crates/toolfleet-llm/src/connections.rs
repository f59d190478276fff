//! The HTTP connections of one client.
//!
//! Over HTTP/1.1 one `reqwest` client is enough: its pool opens a
//! connection per call in flight, and a connection that fails is closed,
//! never handed out again.
//!
//! Over HTTP/2 a `reqwest` client keeps one connection per server, which
//! every call in flight shares — little memory per waiting call, but one
//! point of failure: a connection that breaks fails every call on it at
//! once. So an HTTP/2 client holds [`H2_CONNECTIONS`] clients, each with
//! its own connection, and gives them to calls in turn; a call that loses
//! its connection replaces that client with a fresh one (a new pool, so a
//! new connection) before it is tried again — on the next client in turn.
//! A dead connection is never asked again, and one that breaks costs the
//! calls on it a retry, not their answers.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::HttpVersion;

/// How many connections an HTTP/2 client spreads its calls over.
pub(crate) const H2_CONNECTIONS: usize = 4;

/// One call's connection: the client it was sent on, and which one that
/// was (to replace it if its connection breaks).
pub(crate) struct Conn {
    pub(crate) client: reqwest::Client,
    slot: usize,
    generation: u64,
}

/// The clients of one [`crate::LlmClient`], shared by its clones.
pub(crate) struct Connections {
    slots: Box<[Mutex<Slot>]>,
    next: AtomicUsize,
    http: HttpVersion,
    connect_timeout: Duration,
}

struct Slot {
    /// Bumped each time the slot's client is replaced.
    generation: u64,
    client: reqwest::Client,
}

impl Connections {
    /// The clients for `http`, each connecting within `connect_timeout`.
    pub(crate) fn new(
        http: HttpVersion,
        connect_timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let count = match http {
            HttpVersion::Http1 => 1,
            HttpVersion::Http2 => H2_CONNECTIONS,
        };
        let slots = (0..count)
            .map(|_| {
                Ok(Mutex::new(Slot {
                    generation: 0,
                    client: build(http, connect_timeout)?,
                }))
            })
            .collect::<Result<Vec<_>, reqwest::Error>>()?;
        Ok(Self {
            slots: slots.into_boxed_slice(),
            next: AtomicUsize::new(0),
            http,
            connect_timeout,
        })
    }

    /// The client for the next call (in turn).
    pub(crate) fn take(&self) -> Conn {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let held = self.slots[slot].lock().unwrap_or_else(|e| e.into_inner());
        Conn {
            client: held.client.clone(),
            slot,
            generation: held.generation,
        }
    }

    /// `conn`'s connection broke: its slot gets a fresh client, unless
    /// another call of the same connection replaced it already. (HTTP/1.1:
    /// nothing to do, the pool closes a failed connection itself.)
    pub(crate) fn broken(&self, conn: &Conn) {
        if self.http == HttpVersion::Http1 {
            return;
        }
        // Built before the lock (a client's TLS setup is not quick); the
        // build cannot fail where it did not the first time (same
        // settings), and if it did the old client would stay.
        let Ok(fresh) = build(self.http, self.connect_timeout) else {
            return;
        };
        let mut held = self.slots[conn.slot]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if held.generation != conn.generation {
            return;
        }
        held.client = fresh;
        held.generation += 1;
        tracing::debug!(
            slot = conn.slot,
            "an HTTP/2 connection to the model broke; replaced"
        );
    }
}

fn build(http: HttpVersion, connect_timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    let builder = reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        // A request body is sent once and not kept (see `LlmClient::send`),
        // so a redirect could not be followed with it: the call fails with
        // the new location instead (configure that URL).
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("toolfleet/", env!("CARGO_PKG_VERSION")));
    match http {
        HttpVersion::Http1 => builder.http1_only(),
        HttpVersion::Http2 => builder.http2_prior_knowledge(),
    }
    .build()
}
