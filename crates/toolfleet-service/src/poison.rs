//! Poison messages: jobs whose headers the NATS client cannot read.
//!
//! JetStream stores any header bytes a publisher sends, but async-nats
//! treats a header block it cannot parse (a value that is not UTF-8, a line
//! without `:`, a bad name) as a broken connection: the receiving process
//! disconnects, every other message of that pull is lost with the
//! connection, and the poison is redelivered after each ack wait to do it
//! again. No handler ever sees it.
//!
//! So the poison is found from outside the delivery path. After a
//! reconnection (and once at start) a pull loop [`sweep`]s its consumer:
//! every message delivered and not yet acked (stream sequences between the
//! consumer's ack floor and its last delivery) is read with
//! `$JS.API.STREAM.MSG.GET`, whose JSON reply carries the headers
//! base64-encoded — safe to read — and one whose headers the client would
//! refuse is deleted from the stream and handed back as a [`Poison`] for
//! the caller to dead-letter and answer. A poison costs one disconnect per
//! consumer; the messages lost with that connection come back after one
//! ack wait.
//!
//! (The other way in — a patched async-nats whose parser skips the bad
//! message instead of failing the connection — would mean carrying a fork
//! of the client; this keeps the released crate.)

use async_nats::jetstream::{self, response::Response};
use base64::Engine as _;
use serde::Deserialize;
use tracing::warn;

/// At most this many pending messages are read per sweep (a sweep after
/// a reconnection of a busy consumer stays cheap; the rest is read by the
/// next one).
pub const MAX_SWEEP: usize = 1_000;

/// How far back from the consumer's last delivery a sweep reads, in stream
/// sequences.
pub const MAX_SWEEP_SPAN: u64 = 10_000;

/// A job whose headers the client cannot read, removed from its stream.
#[derive(Debug, Clone)]
pub struct Poison {
    pub stream_sequence: u64,
    pub subject: String,
    /// The header block as stored, base64 (standard alphabet).
    pub raw_headers: String,
    /// Why the client refuses the headers.
    pub reason: String,
    pub payload: Vec<u8>,
    /// The header lines that could be read, lossily decoded.
    headers: Vec<(String, String)>,
}

impl Poison {
    /// A header's value (first one, name matched case-insensitively), if it
    /// is valid UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Would async-nats accept this header block? `Err` says why not. The rules
/// are the client's: UTF-8 throughout, a `NATS/1.0` version line with an
/// optional numeric status, then `Name: value` lines (continuations start
/// with whitespace) whose names are visible ASCII without `:`.
pub fn check_headers(block: &[u8]) -> Result<(), String> {
    let text =
        std::str::from_utf8(block).map_err(|e| format!("header block is not UTF-8 ({e})"))?;
    let mut lines = text.lines();
    let version = lines.next().unwrap_or_default();
    let Some(rest) = version.strip_prefix("NATS/1.0") else {
        return Err("header block does not start with NATS/1.0".into());
    };
    let status = rest.trim().split(' ').next().unwrap_or_default();
    if !status.is_empty() && status.parse::<u16>().is_err() {
        return Err(format!("header status {status:?} is not a number"));
    }
    let mut previous = false;
    for line in lines {
        if line.is_empty() {
            continue;
        }
        if previous && line.starts_with(char::is_whitespace) {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else {
            return Err("a header line has no ':'".into());
        };
        if name.contains(|c: char| !c.is_ascii_graphic()) {
            return Err(format!("header name {name:?} is not visible ASCII"));
        }
        previous = true;
    }
    Ok(())
}

/// The readable `Name: value` lines of a header block (lossy UTF-8).
fn header_lines(block: &[u8]) -> Vec<(String, String)> {
    block
        .split(|b| *b == b'\n')
        .skip(1)
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|b| *b == b':')?;
            let name = std::str::from_utf8(&line[..colon]).ok()?.trim().to_string();
            let value = std::str::from_utf8(&line[colon + 1..])
                .ok()?
                .trim()
                .to_string();
            Some((name, value))
        })
        .collect()
}

#[derive(Deserialize)]
struct Stored {
    message: StoredMessage,
}

#[derive(Deserialize)]
struct StoredMessage {
    subject: String,
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

/// Reads the messages `consumer` has delivered and not had acked, removes
/// those whose headers the client cannot read from `stream`, and returns
/// them. Errors (NATS gone again) end the sweep early; they are logged.
pub async fn sweep(
    js: &jetstream::Context,
    stream: &str,
    consumer: &mut jetstream::consumer::Consumer<jetstream::consumer::pull::Config>,
) -> Vec<Poison> {
    let info = match consumer.info().await {
        Ok(info) => info.clone(),
        Err(e) => {
            warn!(stream, error = %e, "poison sweep: cannot read the consumer");
            return Vec::new();
        }
    };
    if info.num_ack_pending == 0 {
        return Vec::new();
    }
    let filter = info.config.filter_subject.clone();
    let last = info.delivered.stream_sequence;
    // The poison is among the latest deliveries (it broke the connection
    // that received them): read back at most `MAX_SWEEP_SPAN` sequences
    // from the last one, so an old job holding the ack floor cannot push it
    // out of reach.
    let mut next = (info.ack_floor.stream_sequence + 1).max(last.saturating_sub(MAX_SWEEP_SPAN));
    let mut found = Vec::new();
    let engine = base64::engine::general_purpose::STANDARD;
    for _ in 0..MAX_SWEEP {
        if next > last {
            break;
        }
        let mut request = serde_json::json!({ "seq": next });
        if !filter.is_empty() {
            request["next_by_subj"] = filter.clone().into();
        }
        let reply: Result<Response<Stored>, _> = js
            .request(format!("STREAM.MSG.GET.{stream}"), &request)
            .await;
        let stored = match reply {
            Ok(Response::Ok(stored)) => stored.message,
            // No message at or after `next` (10037): done.
            Ok(Response::Err { .. }) => break,
            Err(e) => {
                warn!(stream, error = %e, "poison sweep: cannot read a message");
                break;
            }
        };
        if stored.seq > last {
            break;
        }
        next = stored.seq + 1;
        let Some(raw) = stored.hdrs else { continue };
        let Ok(block) = engine.decode(raw.as_bytes()) else {
            continue;
        };
        let Err(reason) = check_headers(&block) else {
            continue;
        };
        let payload = stored
            .data
            .and_then(|d| engine.decode(d.as_bytes()).ok())
            .unwrap_or_default();
        let deleted: Result<Response<serde_json::Value>, _> = js
            .request(
                format!("STREAM.MSG.DELETE.{stream}"),
                &serde_json::json!({ "seq": stored.seq, "no_erase": true }),
            )
            .await;
        if !matches!(deleted, Ok(Response::Ok(_))) {
            warn!(
                stream,
                seq = stored.seq,
                "poison sweep: cannot delete a poison message"
            );
            continue;
        }
        warn!(stream, seq = stored.seq, subject = %stored.subject, %reason, "removed a job whose headers the client cannot read");
        found.push(Poison {
            stream_sequence: stored.seq,
            subject: stored.subject,
            raw_headers: raw,
            reason,
            payload,
            headers: header_lines(&block),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_the_client_reads_pass_and_others_say_why() {
        assert!(check_headers(b"NATS/1.0\r\nA: b\r\nC: d\r\n\r\n").is_ok());
        assert!(check_headers(b"NATS/1.0 503\r\n\r\n").is_ok());
        assert!(check_headers(b"NATS/1.0\r\nA: b\r\n  more\r\n\r\n").is_ok());
        let bad: [&[u8]; 5] = [
            b"NATS/1.0\r\nToolfleet-Tenant: \xff\xfe\r\n\r\n",
            b"HTTP/1.1\r\n\r\n",
            b"NATS/1.0 abc\r\n\r\n",
            b"NATS/1.0\r\nno colon here\r\n\r\n",
            b"NATS/1.0\r\nBad Name: v\r\n\r\n",
        ];
        for block in bad {
            assert!(check_headers(block).is_err(), "{block:?}");
        }
    }

    #[test]
    fn readable_lines_of_a_poison_block_are_kept() {
        let block =
            b"NATS/1.0\r\nToolfleet-Tenant: \xff\xfe\r\nToolfleet-Invocation-Id: inv-1\r\n\r\n";
        let p = Poison {
            stream_sequence: 1,
            subject: "s".into(),
            raw_headers: String::new(),
            reason: String::new(),
            payload: Vec::new(),
            headers: header_lines(block),
        };
        assert_eq!(p.header("toolfleet-invocation-id"), Some("inv-1"));
        assert_eq!(p.header("Toolfleet-Tenant"), None);
    }
}
