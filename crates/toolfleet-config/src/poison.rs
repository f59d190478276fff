//! The poison guard: how many unreadable chat jobs a tenant may send
//! before its chat jobs are refused for a while (issue 29).
//!
//! A poison is a chat job that cannot be read: headers the NATS client
//! cannot parse, or a body that does not decode (size, JSON, schema). Each
//! is answered and dead-lettered; the orchestrators count them per tenant
//! (in Redis, shared), and a tenant whose count within the window reaches
//! the limit is suspended: for the cool-off, each of its chat jobs ends at
//! once with `tenant_suspended`, without running. Keys go in a tenant's
//! table, or in `[tenant_defaults]` for every tenant without its own:
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `poison_limit` | integer, `20` | poisons within the window that suspend the tenant; `0`: never suspend (poisons are still counted and answered) |
//! | `poison_window_secs` | integer 1-86400, `60` | the window the count covers, from the first poison counted in it |
//! | `poison_cooloff_secs` | integer 1-86400, `300` | how long a suspension lasts; a tenant is served again when it ends |

use std::time::Duration;

use crate::FleetConfig;

/// Poisons within the window that suspend a tenant, by default.
pub const DEFAULT_POISON_LIMIT: u32 = 20;
/// The window of the count, by default.
pub const DEFAULT_POISON_WINDOW: Duration = Duration::from_secs(60);
/// How long a suspension lasts, by default.
pub const DEFAULT_POISON_COOLOFF: Duration = Duration::from_secs(300);
/// The longest window or cool-off the file may set.
pub const MAX_POISON_SECS: u64 = 86_400;

/// A tenant's poison guard, resolved: its own key, else
/// `[tenant_defaults]`'s, else the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoisonPolicy {
    /// Poisons within `window` that suspend the tenant; 0: never.
    pub limit: u32,
    pub window: Duration,
    pub cooloff: Duration,
}

impl FleetConfig {
    /// The poison guard of `tenant`.
    pub fn poison_policy(&self, tenant: &str) -> PoisonPolicy {
        PoisonPolicy {
            limit: self
                .tenant_key(tenant, |t| t.poison_limit)
                .unwrap_or(DEFAULT_POISON_LIMIT),
            window: self
                .tenant_key(tenant, |t| t.poison_window_secs)
                .map_or(DEFAULT_POISON_WINDOW, Duration::from_secs),
            cooloff: self
                .tenant_key(tenant, |t| t.poison_cooloff_secs)
                .map_or(DEFAULT_POISON_COOLOFF, Duration::from_secs),
        }
    }

    /// Every window and cool-off in range (`tenant_defaults` and each
    /// tenant's table).
    pub(crate) fn check_poison(&self) -> Result<(), (String, String)> {
        let tables = std::iter::once(("tenant_defaults".to_owned(), &self.tenant_defaults)).chain(
            self.tenants
                .iter()
                .map(|(name, t)| (format!("tenants.{name}"), t)),
        );
        for (table, tenant) in tables {
            for (key, value) in [
                ("poison_window_secs", tenant.poison_window_secs),
                ("poison_cooloff_secs", tenant.poison_cooloff_secs),
            ] {
                if let Some(secs) = value.filter(|s| !(1..=MAX_POISON_SECS).contains(s)) {
                    return Err((
                        format!("{table}.{key}"),
                        format!("must be between 1 and {MAX_POISON_SECS} seconds, not {secs}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MINIMAL as BASE;

    #[test]
    fn a_tenant_key_wins_over_the_defaults_table_which_wins_over_the_default() {
        let config = crate::testing::parse(&format!(
            "{BASE}
            [tenant_defaults]
            poison_limit = 5
            poison_cooloff_secs = 30
            [tenants.acme]
            poison_limit = 2
            poison_window_secs = 10
            [tenants.initech]
            poison_limit = 0
            "
        ))
        .expect("loads");
        assert_eq!(
            config.poison_policy("acme"),
            PoisonPolicy {
                limit: 2,
                window: Duration::from_secs(10),
                cooloff: Duration::from_secs(30),
            }
        );
        assert_eq!(
            config.poison_policy("globex"),
            PoisonPolicy {
                limit: 5,
                window: DEFAULT_POISON_WINDOW,
                cooloff: Duration::from_secs(30),
            }
        );
        assert_eq!(config.poison_policy("initech").limit, 0);
        let plain = crate::testing::parse(BASE).expect("loads");
        assert_eq!(
            plain.poison_policy("acme"),
            PoisonPolicy {
                limit: DEFAULT_POISON_LIMIT,
                window: DEFAULT_POISON_WINDOW,
                cooloff: DEFAULT_POISON_COOLOFF,
            }
        );
    }

    #[test]
    fn a_window_or_cooloff_out_of_range_is_refused_with_its_key() {
        for (table, says) in [
            (
                "[tenants.acme]\npoison_window_secs = 0",
                "tenants.acme.poison_window_secs",
            ),
            (
                "[tenant_defaults]\npoison_cooloff_secs = 86401",
                "tenant_defaults.poison_cooloff_secs",
            ),
        ] {
            let e = crate::testing::parse(&format!("{BASE}\n{table}")).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
        let e = crate::testing::parse(&format!("{BASE}\n[tenants.acme]\npoison_limit = -1"))
            .unwrap_err();
        assert!(e.to_string().contains("poison_limit"), "{e}");
    }
}
