//! [`PayloadLimits`]: how big a job the orchestrator may send or take.
//!
//! Two limits apply at once: the contract's [`MAX_JOB_BYTES`] of job body,
//! and the NATS server's `max_payload`, which counts headers and body
//! together. The server's default `max_payload` is 1 MiB — exactly
//! `MAX_JOB_BYTES` — so with it the largest body the contract allows
//! cannot travel with its headers. Every check here uses the smaller of the
//! two, and the orchestrator says at start what the server's limit means
//! (a notice for the default, a warning when it refuses bodies the
//! contract allows).

use async_nats::HeaderMap;
use toolfleet_protocol::MAX_JOB_BYTES;

/// Room for a job's headers on top of its body when judging whether the
/// server holds what the contract allows: the context headers of a tool
/// job take a few hundred bytes; this leaves room for long tenant or user
/// values.
pub const JOB_HEADER_ROOM: usize = 4 * 1024;

/// The size limits jobs are held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadLimits {
    /// The server's `max_payload`; `None` when not known (not connected).
    max_payload: Option<usize>,
}

/// A job does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the job body is {body} bytes; at most {limit} fit")]
pub struct TooLarge {
    pub body: usize,
    /// The largest body that would have fitted with the same headers.
    pub limit: usize,
}

impl PayloadLimits {
    /// Limits for a server whose `max_payload` is this (0: unknown).
    pub fn new(max_payload: usize) -> Self {
        Self {
            max_payload: (max_payload > 0).then_some(max_payload),
        }
    }

    /// Limits of the server `client` is connected to.
    pub fn of(client: &async_nats::Client) -> Self {
        Self::new(client.max_payload())
    }

    /// The largest job body accepted when its headers are not known: the
    /// smaller of [`MAX_JOB_BYTES`] and `max_payload`.
    pub fn job_body(&self) -> usize {
        self.max_payload
            .map_or(MAX_JOB_BYTES, |m| m.min(MAX_JOB_BYTES))
    }

    /// Does a job of `body` bytes with `headers` fit both the contract and
    /// the server?
    pub fn check_job(&self, headers: &HeaderMap, body: usize) -> Result<(), TooLarge> {
        let by_server = self
            .max_payload
            .map_or(usize::MAX, |m| m.saturating_sub(header_bytes(headers)));
        let limit = by_server.min(MAX_JOB_BYTES);
        if body > limit {
            return Err(TooLarge { body, limit });
        }
        Ok(())
    }

    /// What to log at start about the server's `max_payload`: a warning
    /// when it refuses bodies the contract allows ([`MAX_JOB_BYTES`]), a
    /// notice when only the largest bodies plus their headers do not fit
    /// (NATS's default 1 MiB), nothing when every job fits.
    pub fn startup_message(&self) -> Option<(Severity, String)> {
        let max_payload = self.max_payload?;
        let needed = MAX_JOB_BYTES + JOB_HEADER_ROOM;
        if max_payload >= needed {
            return None;
        }
        let severity = if max_payload < MAX_JOB_BYTES {
            Severity::Warning
        } else {
            Severity::Notice
        };
        Some((
            severity,
            format!(
                "the NATS server's max_payload is {max_payload} bytes; a job (body plus headers) \
                 must fit in it, so bodies near the contract's {MAX_JOB_BYTES} bytes are refused \
                 with job_too_large / too_large; for the full contract set max_payload to at \
                 least {needed} bytes (e.g. `max_payload: 2MB`) in the server configuration"
            ),
        ))
    }
}

/// How loudly [`PayloadLimits::startup_message`] should be logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// A supported configuration with a lower limit (NATS's default).
    Notice,
    /// The server refuses jobs well within the contract.
    Warning,
}

/// The bytes `headers` take on the wire (`NATS/1.0\r\n`, each
/// `Name: value\r\n`, then `\r\n`), which the server counts against
/// `max_payload` with the body.
pub fn header_bytes(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        for value in values {
            len += name.len() + ": \r\n".len() + value.as_str().len();
        }
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("Toolfleet-Invocation-Id", "inv-1");
        h.insert("Nats-Msg-Id", "inv-1.call_1");
        h
    }

    #[test]
    fn header_bytes_count_the_wire_form() {
        let h = headers();
        let wire =
            "NATS/1.0\r\nToolfleet-Invocation-Id: inv-1\r\nNats-Msg-Id: inv-1.call_1\r\n\r\n";
        assert_eq!(header_bytes(&h), wire.len());
    }

    #[test]
    fn the_default_server_limit_is_noted_and_a_lower_one_warned_about() {
        let (severity, message) = PayloadLimits::new(1024 * 1024)
            .startup_message()
            .expect("1 MiB is below body plus headers");
        assert_eq!(severity, Severity::Notice);
        assert!(message.contains("1048576"), "{message}");
        let (severity, _) = PayloadLimits::new(512 * 1024)
            .startup_message()
            .expect("512 KiB refuses bodies the contract allows");
        assert_eq!(severity, Severity::Warning);
        assert_eq!(PayloadLimits::new(8 * 1024 * 1024).startup_message(), None);
        assert_eq!(
            PayloadLimits::new(0).startup_message(),
            None,
            "unknown: nothing"
        );
    }

    #[test]
    fn checks_use_the_smaller_of_the_contract_and_the_server() {
        let h = headers();
        let hb = header_bytes(&h);
        // The server is the smaller: a body the contract allows does not
        // fit with its headers.
        let small = PayloadLimits::new(MAX_JOB_BYTES);
        assert_eq!(small.job_body(), MAX_JOB_BYTES);
        assert_eq!(
            small.check_job(&h, MAX_JOB_BYTES),
            Err(TooLarge {
                body: MAX_JOB_BYTES,
                limit: MAX_JOB_BYTES - hb
            })
        );
        assert_eq!(small.check_job(&h, MAX_JOB_BYTES - hb), Ok(()));
        let tiny = PayloadLimits::new(1000);
        assert_eq!(tiny.job_body(), 1000);
        // The contract is the smaller.
        let big = PayloadLimits::new(8 * MAX_JOB_BYTES);
        assert_eq!(big.job_body(), MAX_JOB_BYTES);
        assert_eq!(
            big.check_job(&h, MAX_JOB_BYTES + 1),
            Err(TooLarge {
                body: MAX_JOB_BYTES + 1,
                limit: MAX_JOB_BYTES
            })
        );
        assert_eq!(big.check_job(&h, MAX_JOB_BYTES), Ok(()));
        // Unknown server limit: the contract alone.
        assert_eq!(PayloadLimits::new(0).job_body(), MAX_JOB_BYTES);
    }
}
