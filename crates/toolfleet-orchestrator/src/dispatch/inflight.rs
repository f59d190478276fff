//! A tenant's tool calls in flight per pool (`max_tool_calls_in_flight`):
//! before a call's job is sent, it takes one of its tenant's places in the
//! tool's pool, fleet-wide ([`toolfleet_store::slots`]), and holds it until
//! the call is answered (or given up). A call that finds them all held
//! waits for one — its tenant's own calls free them — so one tenant never
//! has more than its cap (times one turn's parallel calls, below) of jobs
//! in a pool's queue, ahead of the others'.
//!
//! The calls of one turn that go to the same pool take one place between
//! them: the first waits for it, the others go along (they are answered
//! together, so waiting for one another would never end). A store that
//! cannot be reached lets the call go.

use std::collections::HashSet;
use std::time::Duration;

use toolfleet_protocol::tools::ToolDefinition;
use toolfleet_store::slots::Slot;
use tracing::warn;

use toolfleet_llm::ToolCall;
use toolfleet_protocol::ToolErrorCode;

use super::immediate;
use crate::events::Events;
use crate::metrics::OrchestratorMetrics;
use crate::{Fleet, Invocation, ToolOutcome};

/// How often a waiting call asks again.
const POLL: Duration = Duration::from_millis(50);

/// A call's place in its pool, and the cap's key (to tell calls of the
/// same turn and pool apart).
pub(super) struct Place {
    pub(super) key: String,
    _slot: Slot,
}

/// Why a call got no place.
pub(super) enum NoPlace {
    /// Its deadline passed while it waited.
    Deadline,
}

/// Takes a place for a call of `inv` to `def`'s pool, waiting until
/// `deadline` at most; `Ok(None)` when no cap applies or this turn already
/// holds the pool's place (`held`).
pub(super) async fn take(
    fleet: &Fleet,
    inv: &Invocation,
    def: &ToolDefinition,
    held: &HashSet<String>,
    deadline: tokio::time::Instant,
) -> Result<Option<Place>, NoPlace> {
    let tenant = inv.job.tenant();
    let Some(cap) = fleet
        .config
        .profiles
        .caps_of(tenant)
        .max_tool_calls_in_flight
    else {
        return Ok(None);
    };
    let key = fleet
        .store
        .inflight_key(tenant, &format!("tool:{}", def.id.subject_token()));
    if held.contains(&key) {
        return Ok(None);
    }
    let mut waited = false;
    loop {
        match fleet.store.take_slot(&key, cap).await {
            Ok(Some(slot)) => return Ok(Some(Place { key, _slot: slot })),
            Ok(None) => {}
            Err(e) => {
                warn!(tenant, tool = %def.id, error = %e, "the tenant's tool calls in flight cannot be counted; the call goes");
                return Ok(None);
            }
        }
        if !waited {
            waited = true;
            fleet
                .metrics
                .in_flight_waits
                .with_label_values(&[tenant, "tool_calls"])
                .inc();
        }
        if tokio::time::Instant::now() + POLL > deadline {
            return Err(NoPlace::Deadline);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The answer of a call that got no place before its deadline.
pub(super) fn no_place(
    metrics: &OrchestratorMetrics,
    events: &Events,
    call: &ToolCall,
    tool: &str,
) -> ToolOutcome {
    immediate(
        metrics,
        events,
        call,
        tool,
        ToolErrorCode::Timeout.as_str(),
        format!(
            "Error: {} was not run: this tenant's other calls to its pool took every place \
             (max_tool_calls_in_flight) until the call's time ran out.",
            call.name
        ),
    )
}
