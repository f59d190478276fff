//! Poison messages: jobs whose header block the NATS client cannot read.
//!
//! JetStream stores any header bytes a publisher sends (nats-server does
//! not check them): a value that is not UTF-8, a line without `:`, a bad
//! name or version line. The released async-nats takes such a block for a
//! broken connection — the receiving process disconnects, the messages in
//! flight on it are lost, and the job, redelivered after each ack wait,
//! does it again. The workspace carries async-nats with that fixed
//! (`patches/async-nats`, see its `PATCHES.md`): the message is delivered,
//! with the header lines that could be read and
//! [`async_nats::HeaderMap::invalid`] saying why and holding the block as
//! received.
//!
//! A pull loop takes such a delivery out of the normal path
//! ([`Poison::of`]): its [`crate::jobs::Sweeper`] hands it to the
//! process's `on_poison` (dead-letter it, tell its sender), then
//! terminates it. No disconnect, no redelivery.

use async_nats::jetstream;
use base64::Engine as _;

/// A job whose headers the client cannot read in full.
#[derive(Debug, Clone)]
pub struct Poison {
    pub stream_sequence: u64,
    pub subject: String,
    /// The header block as received, base64 (standard alphabet).
    pub raw_headers: String,
    /// Why the client cannot read the headers (the first problem found).
    pub reason: String,
    pub payload: Vec<u8>,
    /// The header lines that could be read.
    headers: async_nats::HeaderMap,
}

impl Poison {
    /// The poison in `msg`, if its header block could not be read.
    pub fn of(msg: &jetstream::Message) -> Option<Self> {
        let headers = msg.headers.as_ref()?;
        let invalid = headers.invalid()?;
        Some(Self {
            stream_sequence: msg.info().map_or(0, |i| i.stream_sequence),
            subject: msg.subject.to_string(),
            raw_headers: base64::engine::general_purpose::STANDARD.encode(invalid.raw()),
            reason: invalid.reason().to_string(),
            payload: msg.payload.to_vec(),
            headers: headers.clone(),
        })
    }

    /// A header's value (first one) among the lines that could be read.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.as_str())
    }
}
