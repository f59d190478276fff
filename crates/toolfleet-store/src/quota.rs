//! A tenant's fleet-wide rate limits and budgets: what its model calls
//! used in the current minute, day and month, counted in Redis so every
//! orchestrator (and LLM-tool worker) shares one count.
//!
//! Keys, all under the tenant's hash tag `{<tenant>}` (no `/`, so never an
//! invocation's tag), so one check touches one slot of a cluster:
//!
//! | key | type | holds | TTL |
//! |---|---|---|---|
//! | `<p>:{<t>}:quota:req:<minute>` | string (INCR) | model calls admitted in that UTC minute (unix minutes) | 2 min |
//! | `<p>:{<t>}:quota:tok:<minute>` | string (INCRBY) | tokens of the calls that ended in that minute | 2 min |
//! | `<p>:{<t>}:quota:day:<day>` | string (INCRBY) | spend in millionths of a USD that UTC day (unix days) | 2 days |
//! | `<p>:{<t>}:quota:month:<yyyymm>` | string (INCRBY) | spend in millionths of a USD that UTC month | 62 days |
//! | `<p>:{<t>}:quota:once:<token>` | string | a call's admission or usage already counted (a retry after a lost answer counts nothing twice) | 5 min |
//!
//! [`CitationStore::admit_model_call`] checks and counts in one script, so
//! two processes never both take the last request of a minute.
//! [`CitationStore::record_model_usage`] adds what a call used once it
//! ended: tokens and spend can overshoot by what the calls in flight use.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{CitationError, CitationStore};

const ADMIT: &str = r"
local function num(k) return tonumber(redis.call('GET', k) or '0') or 0 end
local req, tok, day, month = num(KEYS[1]), num(KEYS[2]), num(KEYS[3]), num(KEYS[4])
if redis.call('EXISTS', KEYS[5]) == 1 then return {0, req, tok, day, month} end
local rpm, tpm, per_day, per_month = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if per_month > 0 and month >= per_month then return {4, req, tok, day, month} end
if per_day > 0 and day >= per_day then return {3, req, tok, day, month} end
if tpm > 0 and tok >= tpm then return {2, req, tok, day, month} end
if rpm > 0 and req >= rpm then return {1, req, tok, day, month} end
req = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('SET', KEYS[5], '1', 'PX', ARGV[6])
return {0, req, tok, day, month}
";

const RECORD: &str = r"
if redis.call('EXISTS', KEYS[4]) == 0 then
  for i = 1, 3 do
    redis.call('INCRBY', KEYS[i], ARGV[i])
    redis.call('PEXPIRE', KEYS[i], ARGV[i + 3])
  end
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[7])
end
local function num(k) return tonumber(redis.call('GET', k) or '0') or 0 end
return {num(KEYS[1]), num(KEYS[2]), num(KEYS[3])}
";

const MINUTE_TTL: Duration = Duration::from_secs(120);
const DAY_TTL: Duration = Duration::from_secs(2 * 86_400);
const MONTH_TTL: Duration = Duration::from_secs(62 * 86_400);
const ONCE_TTL: Duration = Duration::from_secs(300);

/// A tenant's fleet-wide limits; 0 is no limit (the limits tool jobs
/// carry to the workers that call models, too).
pub type QuotaLimits = toolfleet_protocol::TenantLimits;

/// Which limit refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuotaLimit {
    RequestsPerMinute,
    TokensPerMinute,
    SpendPerDay,
    SpendPerMonth,
}

impl QuotaLimit {
    /// The configuration key that sets it (also its metric label and the
    /// `limit` of a `limit_warning` event).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RequestsPerMinute => "requests_per_minute",
            Self::TokensPerMinute => "tokens_per_minute",
            Self::SpendPerDay => "spend_per_day_usd",
            Self::SpendPerMonth => "spend_per_month_usd",
        }
    }

    /// A rate (`rate_limited`) rather than a budget (`budget_exhausted`).
    pub fn is_rate(self) -> bool {
        matches!(self, Self::RequestsPerMinute | Self::TokensPerMinute)
    }
}

/// The clock windows a moment falls in (UTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaWindows {
    /// Unix minutes.
    pub minute: u64,
    /// Unix days.
    pub day: u64,
    /// `yyyymm`.
    pub month: u64,
    /// Time left in the minute, the day and the month.
    pub minute_left: Duration,
    pub day_left: Duration,
    pub month_left: Duration,
}

impl QuotaWindows {
    /// The windows of `at`.
    pub fn at(at: SystemTime) -> Self {
        let ms = u64::try_from(
            at.duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis(),
        )
        .unwrap_or(u64::MAX);
        let minute = ms / 60_000;
        let day = ms / 86_400_000;
        let (year, month) = civil_month(day);
        let (next_year, next_month) = if month == 12 {
            (year + 1, 1)
        } else {
            (year, month + 1)
        };
        let next_month_day = days_from_civil(next_year, next_month);
        Self {
            minute,
            day,
            month: year * 100 + month,
            minute_left: Duration::from_millis((minute + 1) * 60_000 - ms),
            day_left: Duration::from_millis((day + 1) * 86_400_000 - ms),
            month_left: Duration::from_millis(next_month_day * 86_400_000 - ms),
        }
    }

    /// How long until `limit`'s window renews.
    pub fn left(&self, limit: QuotaLimit) -> Duration {
        match limit {
            QuotaLimit::RequestsPerMinute | QuotaLimit::TokensPerMinute => self.minute_left,
            QuotaLimit::SpendPerDay => self.day_left,
            QuotaLimit::SpendPerMonth => self.month_left,
        }
    }
}

/// (year, month 1..=12) of unix day `days` (Howard Hinnant's
/// `civil_from_days`, for days after 1970).
fn civil_month(days: u64) -> (u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month)
}

/// The unix day of the first of `month` in `year` (`days_from_civil`).
fn days_from_civil(year: u64, month: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// What a tenant has used in the current windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaUsage {
    /// Model calls admitted this minute (this one included once admitted).
    pub requests: u64,
    /// Tokens of calls that ended this minute.
    pub tokens: u64,
    /// Millionths of a USD spent today.
    pub spend_day_micros: u64,
    /// Millionths of a USD spent this month.
    pub spend_month_micros: u64,
}

impl QuotaUsage {
    /// What is used of `limit`, in its unit (millionths of a USD for spend).
    pub fn of(&self, limit: QuotaLimit) -> u64 {
        match limit {
            QuotaLimit::RequestsPerMinute => self.requests,
            QuotaLimit::TokensPerMinute => self.tokens,
            QuotaLimit::SpendPerDay => self.spend_day_micros,
            QuotaLimit::SpendPerMonth => self.spend_month_micros,
        }
    }
}

impl QuotaLimit {
    /// This limit's value in `limits` (0: none).
    pub fn cap_in(self, limits: &QuotaLimits) -> u64 {
        match self {
            QuotaLimit::RequestsPerMinute => limits.requests_per_minute,
            QuotaLimit::TokensPerMinute => limits.tokens_per_minute,
            QuotaLimit::SpendPerDay => limits.spend_per_day_micros,
            QuotaLimit::SpendPerMonth => limits.spend_per_month_micros,
        }
    }
}

/// What [`CitationStore::admit_model_call`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The call may go ahead; it is counted.
    Admitted(QuotaUsage),
    /// `limit` is reached; nothing was counted. `retry_after`: until its
    /// window renews.
    Refused {
        limit: QuotaLimit,
        usage: QuotaUsage,
        retry_after: Duration,
    },
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl CitationStore {
    /// `tenant`'s quota key `part` (see the module's table).
    fn quota_key(&self, tenant: &str, part: &str) -> String {
        format!("{}:{{{tenant}}}:quota:{part}", self.prefix)
    }

    /// Admits one model call of `tenant` under `limits` in `windows`, or
    /// refuses it at the first limit reached (month, day, tokens, then
    /// requests), counting the request only when admitted — check and
    /// count are one script. `token` names the call: repeating it (a retry
    /// after a lost answer) admits without counting again.
    pub async fn admit_model_call(
        &self,
        tenant: &str,
        limits: &QuotaLimits,
        windows: &QuotaWindows,
        token: &str,
    ) -> Result<Admission, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(ADMIT));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.quota_key(tenant, &format!("req:{}", windows.minute)))
            .key(self.quota_key(tenant, &format!("tok:{}", windows.minute)))
            .key(self.quota_key(tenant, &format!("day:{}", windows.day)))
            .key(self.quota_key(tenant, &format!("month:{}", windows.month)))
            .key(self.quota_key(tenant, &format!("once:{token}")))
            .arg(limits.requests_per_minute)
            .arg(limits.tokens_per_minute)
            .arg(limits.spend_per_day_micros)
            .arg(limits.spend_per_month_micros)
            .arg(ms(MINUTE_TTL))
            .arg(ms(ONCE_TTL));
        let invocation = &invocation;
        let (refused, requests, tokens, day, month): (u8, u64, u64, u64, u64) = self
            .run("admit_model_call", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        let usage = QuotaUsage {
            requests,
            tokens,
            spend_day_micros: day,
            spend_month_micros: month,
        };
        let limit = match refused {
            0 => return Ok(Admission::Admitted(usage)),
            1 => QuotaLimit::RequestsPerMinute,
            2 => QuotaLimit::TokensPerMinute,
            3 => QuotaLimit::SpendPerDay,
            _ => QuotaLimit::SpendPerMonth,
        };
        Ok(Admission::Refused {
            limit,
            usage,
            retry_after: windows.left(limit),
        })
    }

    /// Adds what one model call of `tenant` used (`tokens`, and `micros`
    /// millionths of a USD) to the windows it ended in, and answers the
    /// totals. `token` names the call: repeating it adds nothing again.
    pub async fn record_model_usage(
        &self,
        tenant: &str,
        windows: &QuotaWindows,
        tokens: u64,
        micros: u64,
        token: &str,
    ) -> Result<QuotaUsage, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(RECORD));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.quota_key(tenant, &format!("tok:{}", windows.minute)))
            .key(self.quota_key(tenant, &format!("day:{}", windows.day)))
            .key(self.quota_key(tenant, &format!("month:{}", windows.month)))
            .key(self.quota_key(tenant, &format!("once:{token}:used")))
            .arg(tokens)
            .arg(micros)
            .arg(micros)
            .arg(ms(MINUTE_TTL))
            .arg(ms(DAY_TTL))
            .arg(ms(MONTH_TTL))
            .arg(ms(ONCE_TTL));
        let invocation = &invocation;
        let (tokens, day, month): (u64, u64, u64) = self
            .run("record_model_usage", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(QuotaUsage {
            requests: 0,
            tokens,
            spend_day_micros: day,
            spend_month_micros: month,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_utc_minutes_days_and_calendar_months() {
        // 2024-02-29T23:59:30Z, a leap day.
        let at = UNIX_EPOCH + Duration::from_secs(1_709_251_170);
        let w = QuotaWindows::at(at);
        assert_eq!(w.month, 202_402);
        assert_eq!(w.day, 19_782);
        assert_eq!(w.minute_left, Duration::from_secs(30));
        assert_eq!(w.day_left, Duration::from_secs(30));
        assert_eq!(w.month_left, Duration::from_secs(30));
        // 2026-12-31T12:00:00Z: the month ends with the year.
        let w = QuotaWindows::at(UNIX_EPOCH + Duration::from_secs(1_798_718_400));
        assert_eq!(w.month, 202_612);
        assert_eq!(w.month_left, Duration::from_secs(12 * 3600));
        assert_eq!(civil_month(0), (1970, 1));
        assert_eq!(days_from_civil(1970, 1), 0);
        assert_eq!(days_from_civil(2000, 3), 11_017);
    }
}
