//! Approval settings of a profile: which tools a person must approve
//! before they run (besides those whose definition sets
//! `requiresApproval`), and how long a parked invocation waits for them.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `profiles.<name>.require_approval` | list of tool refs, `[]` | tools whose every call a person must approve under this profile (same patterns as `tools`) |
//! | `profiles.<name>.approval_timeout_ms` | 1000..=604800000, `3600000` | how long a parked invocation waits for its approvals before it ends with `approval_timeout` |

/// Default of [`Profile::approval_timeout_ms`](crate::Profile::approval_timeout_ms):
/// one hour.
pub const DEFAULT_APPROVAL_TIMEOUT_MS: u64 = 3_600_000;
/// The longest [`Profile::approval_timeout_ms`](crate::Profile::approval_timeout_ms)
/// a file may set: a week.
pub const MAX_APPROVAL_TIMEOUT_MS: u64 = 7 * 24 * 3_600_000;

pub(crate) fn default_approval_timeout_ms() -> u64 {
    DEFAULT_APPROVAL_TIMEOUT_MS
}

/// Between a second and [`MAX_APPROVAL_TIMEOUT_MS`]; `at` is the key path.
pub(crate) fn check_timeout(timeout_ms: u64, at: &str) -> Result<(), (String, String)> {
    if (1_000..=MAX_APPROVAL_TIMEOUT_MS).contains(&timeout_ms) {
        return Ok(());
    }
    Err((
        at.to_owned(),
        format!(
            "must be between 1000 (a second) and {MAX_APPROVAL_TIMEOUT_MS} (a week), not {timeout_ms}"
        ),
    ))
}
