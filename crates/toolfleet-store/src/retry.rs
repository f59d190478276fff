//! Transient Redis errors, retried with exponential backoff and jitter
//! inside a total budget.
//!
//! Every store operation is safe to repeat after an ambiguous failure (the
//! command may have run before the connection broke): a reservation is
//! keyed by its name and returns the same indices, writes are plain SETs,
//! and a claim that finds its own owner is a success.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use redis::{ErrorKind as RedisKind, RedisError, ServerErrorKind};

const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// An attempt that starts with less budget left still gets this long, so
/// the last try is not cut off before it could answer.
const MIN_ATTEMPT: Duration = Duration::from_millis(250);

/// Is this error worth another try: the server is restarting, loading,
/// failing over, or the connection broke or timed out?
pub(crate) fn is_transient(e: &RedisError) -> bool {
    match e.kind() {
        RedisKind::Io => io_is_transient(e),
        RedisKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::ReadOnly
        ),
        RedisKind::ClusterConnectionNotFound => true,
        _ => false,
    }
}

fn io_is_transient(e: &RedisError) -> bool {
    // A TLS failure (bad certificate) or a refused permission is an IO
    // error too, but another try will not fix it. Under load the cluster
    // client may wrap the rustls error in any IO kind: its wording decides.
    if is_tls_rejection(&e.to_string()) || e.detail().is_some_and(is_tls_rejection) {
        return false;
    }
    match io_kind(e) {
        Some(kind) => !matches!(
            kind,
            io::ErrorKind::InvalidData
                | io::ErrorKind::InvalidInput
                | io::ErrorKind::PermissionDenied
                | io::ErrorKind::Unsupported
        ),
        // The cluster client reports a failed first connection as text
        // only ("Failed to create initial connections - Io: <cause>"), so
        // a TLS rejection is recognised by rustls's wording there.
        None => !e.detail().is_some_and(is_tls_rejection),
    }
}

/// rustls's messages for a handshake that will fail again: a certificate
/// not trusted, not matching, or missing, or a peer that speaks no common
/// protocol.
fn is_tls_rejection(text: &str) -> bool {
    [
        "invalid peer certificate",
        "peer is incompatible",
        "received fatal alert",
        "peer sent no certificates",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// The kind of the IO error inside a RedisError (it keeps it behind an
/// `Arc<dyn Error>`, which is what `source` hands out).
fn io_kind(e: &RedisError) -> Option<io::ErrorKind> {
    let source = std::error::Error::source(e)?;
    let shared = source.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>()?;
    shared.downcast_ref::<io::Error>().map(io::Error::kind)
}

/// The pause before the attempt after `attempt` (0-based): exponential,
/// capped, with "equal jitter" (half fixed, half random) so many processes
/// that lost Redis together do not come back in step.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let exp = FIRST_BACKOFF.saturating_mul(1u32 << attempt.min(16));
    let capped = exp.min(MAX_BACKOFF);
    let half = capped / 2;
    let jitter = random_u64() % (half.as_micros() as u64 + 1);
    half + Duration::from_micros(jitter)
}

/// The time an attempt may take when `left` of the budget remains.
pub(crate) fn attempt_limit(left: Duration) -> Duration {
    left.max(MIN_ATTEMPT)
}

fn random_u64() -> u64 {
    // RandomState is seeded randomly per process and per instance: enough
    // for jitter, no RNG crate needed.
    let mut h = RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_sorted_into_transient_and_not() {
        let refused: RedisError = io::Error::from(io::ErrorKind::ConnectionRefused).into();
        let reset: RedisError = io::Error::from(io::ErrorKind::ConnectionReset).into();
        let timeout: RedisError = io::Error::from(io::ErrorKind::TimedOut).into();
        let tls: RedisError = io::Error::new(io::ErrorKind::InvalidData, "bad cert").into();
        assert!(is_transient(&refused));
        assert!(is_transient(&reset));
        assert!(is_transient(&timeout));
        assert!(!is_transient(&tls));
        let server = |code: &str| {
            let reply = format!("-{code} detail\r\n");
            redis::parse_redis_value(reply.as_bytes())
                .unwrap()
                .extract_error()
                .unwrap_err()
        };
        for code in ["LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN"] {
            assert!(is_transient(&server(code)), "{code}");
        }
        for code in ["ERR", "WRONGTYPE", "NOSCRIPT", "NOPERM", "WRONGPASS"] {
            assert!(!is_transient(&server(code)), "{code}");
        }
        let cluster_tls = RedisError::from((
            RedisKind::Io,
            "Failed to create initial connections",
            "Io: invalid peer certificate: UnknownIssuer".to_string(),
        ));
        assert!(!is_transient(&cluster_tls));
        let cluster_down = RedisError::from((
            RedisKind::Io,
            "Failed to create initial connections",
            "Io: Connection refused (os error 111)".to_string(),
        ));
        assert!(is_transient(&cluster_down));
        let auth = RedisError::from((RedisKind::AuthenticationFailed, "auth"));
        assert!(!is_transient(&auth));
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        for attempt in 0..20 {
            let d = backoff(attempt);
            let full = FIRST_BACKOFF
                .saturating_mul(1u32 << attempt.min(16))
                .min(MAX_BACKOFF);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        assert_eq!(attempt_limit(Duration::ZERO), MIN_ATTEMPT);
        assert_eq!(
            attempt_limit(Duration::from_secs(2)),
            Duration::from_secs(2)
        );
    }
}
