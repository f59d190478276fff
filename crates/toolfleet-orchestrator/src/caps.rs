//! [`TenantStore`]: what each tenant keeps in the fleet's shared streams,
//! held to its caps ([`toolfleet_config::caps`]) so one tenant's flood can
//! neither fill a shared stream nor push out another tenant's records.
//!
//! - **Stored events.** The events stream keeps each invocation's latest
//!   event, the history stream its events but the deltas; both drop their
//!   oldest messages, of any tenant, past their size. So after storing a
//!   terminal event the orchestrator trims the tenant's own: every
//!   `max(1, cap / 10)` terminal events of a tenant (per process), it
//!   purges that tenant's subjects down to its newest `max_stored_events`
//!   (events) and `max_stored_events × HISTORY_PER_STORED` (history). A
//!   tenant overshoots its cap by at most a tenth of it per orchestrator
//!   between trims; another tenant's events are never touched.
//! - **Parked records.** Every orchestrator watches the parked bucket
//!   (for timeouts); the watch also keeps each tenant's record keys here,
//!   and a new record of a tenant that has `max_parked` is refused
//!   (`too_many_parked`). Parks racing on several orchestrators within the
//!   watch's delay may overshoot by the parks in flight.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use dashmap::DashMap;
use tracing::warn;

use crate::Settings;

/// History events kept per kept invocation of a tenant (its cap on the
/// history stream is `max_stored_events` times this).
pub const HISTORY_PER_STORED: u64 = 20;

/// Per-tenant bookkeeping of what the tenants store (see the module docs).
#[derive(Default)]
pub struct TenantStore {
    /// Terminal events stored per tenant since its last trim here.
    since_trim: DashMap<String, u64>,
    /// The parked bucket's record keys, by tenant, as the watch sees them.
    parked: Mutex<HashMap<String, HashSet<String>>>,
}

/// The tenant of a parked bucket key (`<tenant>.<invocation id>`).
fn tenant_of(key: &str) -> &str {
    key.split_once('.').map_or(key, |(tenant, _)| tenant)
}

impl TenantStore {
    /// A terminal event of `tenant` was stored: trims the tenant's events
    /// and history when it is due (see the module docs). Best effort: a
    /// failed trim is logged and tried at the next one.
    pub(crate) async fn event_stored(
        &self,
        js: &async_nats::jetstream::Context,
        settings: &Settings,
        tenant: &str,
    ) {
        let cap = settings.profiles.caps_of(tenant).max_stored_events;
        let step = (cap / 10).max(1);
        {
            let mut count = self.since_trim.entry(tenant.to_string()).or_insert(0);
            *count += 1;
            if *count < step {
                return;
            }
            *count = 0;
        }
        let subjects = &settings.subjects;
        let trims = [
            (
                subjects.events_stream(),
                subjects.chat_events_of(tenant),
                cap,
            ),
            (
                subjects.history_stream(),
                subjects.chat_history_of(tenant),
                cap.saturating_mul(HISTORY_PER_STORED),
            ),
        ];
        for (stream, filter, keep) in trims {
            if let Err(e) = trim(js, &stream, &filter, keep).await {
                warn!(tenant, stream, error = %e, "cannot trim the tenant's stored events");
            }
        }
    }

    /// The watch saw record `key` stored (`present`) or removed: its
    /// tenant, and how many records that tenant has now.
    pub(crate) fn parked_seen(&self, key: &str, present: bool) -> (String, usize) {
        let tenant = tenant_of(key).to_string();
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        let keys = parked.entry(tenant.clone()).or_default();
        if present {
            keys.insert(key.to_string());
        } else {
            keys.remove(key);
        }
        let count = keys.len();
        (tenant, count)
    }

    /// The watch starts again from the bucket's contents.
    pub(crate) fn parked_reset(&self) {
        self.parked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// `tenant`'s records in the parked bucket, as last seen.
    pub fn parked_of(&self, tenant: &str) -> usize {
        self.parked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
            .map_or(0, HashSet::len)
    }

    /// Whether a record at `key` would be a new one past `cap` of its
    /// tenant (a record that replaces its invocation's own is not new).
    pub(crate) fn parked_full(&self, key: &str, cap: u64) -> bool {
        let parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        let Some(keys) = parked.get(tenant_of(key)) else {
            return cap == 0;
        };
        !keys.contains(key) && keys.len() as u64 >= cap
    }
}

/// Purges `filter`'s messages in `stream` down to the newest `keep`.
async fn trim(
    js: &async_nats::jetstream::Context,
    stream: &str,
    filter: &str,
    keep: u64,
) -> Result<(), String> {
    let stream = js
        .get_stream_no_info(stream)
        .await
        .map_err(|e| e.to_string())?;
    stream
        .purge()
        .filter(filter)
        .keep(keep)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_records_are_counted_per_tenant_and_a_replacement_is_not_new() {
        let store = TenantStore::default();
        store.parked_seen("acme.inv-1", true);
        store.parked_seen("acme.inv-2", true);
        store.parked_seen("globex.inv-1", true);
        assert_eq!(store.parked_of("acme"), 2);
        assert!(store.parked_full("acme.inv-3", 2));
        assert!(!store.parked_full("acme.inv-2", 2), "its own record");
        assert!(!store.parked_full("globex.inv-2", 2));
        assert!(!store.parked_full("initech.inv-1", 1));
        store.parked_seen("acme.inv-1", false);
        assert!(!store.parked_full("acme.inv-3", 2));
        store.parked_reset();
        assert_eq!(store.parked_of("globex"), 0);
    }
}
