//! When a failed model call is sent again, and how long to wait first.
//!
//! The decision is a pure function of the policy, the error, the attempt
//! number, the time spent so far and a random number, so it is tested
//! without a clock or a network. [`LlmClient`](super::LlmClient) adds the
//! one rule that needs the stream: nothing is retried once text or a tool
//! call has reached the caller.

use std::time::Duration;

use super::LlmError;

pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
pub const DEFAULT_MAX_ELAPSED: Duration = Duration::from_secs(30);
pub const DEFAULT_BASE_DELAY: Duration = Duration::from_millis(250);
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(5);

/// How often and for how long a call that failed with a retryable error
/// ([`LlmError::is_retryable`]: connect errors, timeouts, 429 and 5xx) is
/// tried again.
///
/// The wait is the provider's `retry-after-ms` / `Retry-After` when it sent
/// one, otherwise exponential backoff (`base_delay`, doubling per retry, at
/// most `max_delay`) with jitter: a random wait between half and all of it,
/// so clients that failed together do not retry together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Requests in all, the first included; 1 (or 0) disables retries.
    pub max_attempts: u32,
    /// Time budget from the start of the first request: no wait reaches
    /// past it. A provider asking for a longer wait than is left gets the
    /// error back at once instead.
    pub max_elapsed: Duration,
    /// The backoff before the first retry.
    pub base_delay: Duration,
    /// The longest backoff (a provider's own `Retry-After` is not capped
    /// by this, only by `max_elapsed`).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 3 attempts within 30 s, backoff from 250 ms up to 5 s.
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_elapsed: DEFAULT_MAX_ELAPSED,
            base_delay: DEFAULT_BASE_DELAY,
            max_delay: DEFAULT_MAX_DELAY,
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retries.
    pub fn never() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// The wait before trying again after `error` ended attempt `attempt`
    /// (1-based), `elapsed` after the first attempt started; `None` means
    /// give up. `jitter` is a random number in `[0, 1)`.
    pub(crate) fn delay_before_retry(
        &self,
        attempt: u32,
        elapsed: Duration,
        error: &LlmError,
        jitter: f64,
    ) -> Option<Duration> {
        if !error.is_retryable() || attempt >= self.max_attempts.max(1) {
            return None;
        }
        let left = self.max_elapsed.checked_sub(elapsed)?;
        if left.is_zero() {
            return None;
        }
        match error.retry_after() {
            // The provider knows when it will take us again; waiting less
            // would only earn another 429, and there is no point waiting
            // for a slot we could not use in time.
            Some(asked) if asked > left => None,
            Some(asked) => Some(asked),
            None => {
                let doublings = attempt.saturating_sub(1).min(30);
                let full = self
                    .base_delay
                    .saturating_mul(1u32 << doublings)
                    .min(self.max_delay);
                let jitter = if jitter.is_finite() {
                    jitter.clamp(0.0, 1.0)
                } else {
                    0.5
                };
                Some(full.mul_f64(0.5 + 0.5 * jitter).min(left))
            }
        }
    }
}

/// A random number in `[0, 1)`, from the operating system's randomness
/// through `uuid` (no extra dependency for one number per retry).
pub(crate) fn jitter() -> f64 {
    let bits = (uuid::Uuid::new_v4().as_u128() >> 75) as u64; // 53 random bits
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            max_elapsed: Duration::from_secs(10),
            base_delay: 100 * MS,
            max_delay: 300 * MS,
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap() {
        let p = policy();
        let e = LlmError::status(500, None, "x");
        let at = |attempt, jitter| p.delay_before_retry(attempt, Duration::ZERO, &e, jitter);
        assert_eq!(at(1, 0.0), Some(50 * MS));
        assert_eq!(at(1, 1.0), Some(100 * MS));
        assert_eq!(at(2, 0.0), Some(100 * MS));
        assert_eq!(at(2, 1.0), Some(200 * MS));
        assert_eq!(at(3, 1.0), Some(300 * MS), "capped by max_delay");
        assert_eq!(at(4, 0.5), None, "max_attempts reached");
        assert_eq!(at(1, f64::NAN), Some(75 * MS));
    }

    #[test]
    fn retry_after_is_honoured_within_the_time_budget() {
        let p = policy();
        let e = LlmError::status(429, Some("rate_limit_exceeded".into()), "x")
            .with_retry_after(Some(Duration::from_secs(2)));
        assert_eq!(
            p.delay_before_retry(1, Duration::ZERO, &e, 0.0),
            Some(Duration::from_secs(2)),
            "not capped by max_delay"
        );
        assert_eq!(
            p.delay_before_retry(1, Duration::from_secs(9), &e, 0.0),
            None,
            "asks for longer than is left"
        );
        let plain = LlmError::timeout("x");
        assert_eq!(
            p.delay_before_retry(1, Duration::from_millis(9_980), &plain, 1.0),
            Some(20 * MS),
            "backoff is cut to what is left"
        );
        assert_eq!(
            p.delay_before_retry(1, Duration::from_secs(11), &plain, 1.0),
            None
        );
    }

    #[test]
    fn permanent_errors_and_single_attempt_policies_never_retry() {
        let p = policy();
        for e in [
            LlmError::status(400, None, "x"),
            LlmError::status(429, Some("insufficient_quota".into()), "x"),
            LlmError::protocol("x"),
        ] {
            assert_eq!(p.delay_before_retry(1, Duration::ZERO, &e, 0.5), None);
        }
        let e = LlmError::connect("x");
        assert_eq!(
            RetryPolicy::never().delay_before_retry(1, Duration::ZERO, &e, 0.5),
            None
        );
        let zero = RetryPolicy {
            max_attempts: 0,
            ..policy()
        };
        assert_eq!(zero.delay_before_retry(1, Duration::ZERO, &e, 0.5), None);
    }

    #[test]
    fn jitter_stays_in_range() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j), "{j}");
        }
    }

    #[test]
    fn default_policy_is_the_documented_one() {
        assert_eq!(
            RetryPolicy::default(),
            RetryPolicy {
                max_attempts: 3,
                max_elapsed: Duration::from_secs(30),
                base_delay: Duration::from_millis(250),
                max_delay: Duration::from_secs(5),
            }
        );
    }
}
