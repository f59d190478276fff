//! [`TenantQueues`]: work of many tenants, taken in turn — one item of each
//! tenant with work before a second of any — so one tenant's flood waits
//! behind itself only. Each tenant's queue is bounded (an item over the
//! bound is refused, never blocking the caller), and a [`TokenBucket`]
//! per tenant can bound how fast a tenant's items are admitted at all.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::Notify;

/// Why [`TenantQueues::push`] refused an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The tenant's queue holds its bound already.
    Full,
}

/// Per-tenant FIFO queues served round robin over the tenants with work.
pub(crate) struct TenantQueues<T> {
    inner: Mutex<Inner<T>>,
    ready: Notify,
    /// Items one tenant may have waiting.
    per_tenant: usize,
}

struct Inner<T> {
    queues: HashMap<String, VecDeque<T>>,
    /// Tenants with work, in the order they are served next.
    turn: VecDeque<String>,
}

impl<T> TenantQueues<T> {
    /// Queues holding at most `per_tenant` items of each tenant.
    pub(crate) fn new(per_tenant: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                queues: HashMap::new(),
                turn: VecDeque::new(),
            }),
            ready: Notify::new(),
            per_tenant: per_tenant.max(1),
        }
    }

    /// Queues `item` for `tenant`, or refuses it at once when the tenant's
    /// queue is full.
    pub(crate) fn push(&self, tenant: &str, item: T) -> Result<(), Refused> {
        {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let Inner { queues, turn } = &mut *inner;
            let queue = queues.entry(tenant.to_owned()).or_default();
            if queue.len() >= self.per_tenant {
                return Err(Refused::Full);
            }
            if queue.is_empty() {
                turn.push_back(tenant.to_owned());
            }
            queue.push_back(item);
        }
        self.ready.notify_one();
        Ok(())
    }

    /// The next item in turn, if any: the first of the tenant whose turn
    /// it is, which then goes to the back of the turn.
    pub(crate) fn try_pop(&self) -> Option<(String, T)> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Inner { queues, turn } = &mut *inner;
        let tenant = turn.pop_front()?;
        let queue = queues.get_mut(&tenant)?;
        let item = queue.pop_front()?;
        if queue.is_empty() {
            // An empty tenant's queue goes: tenants come and go.
            queues.remove(&tenant);
            return Some((tenant, item));
        }
        turn.push_back(tenant.clone());
        Some((tenant, item))
    }

    /// The next item in turn, waiting for one.
    pub(crate) async fn pop(&self) -> (String, T) {
        loop {
            if let Some(next) = self.try_pop() {
                return next;
            }
            self.ready.notified().await;
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenBucket {
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens.
    pub(crate) fn full(burst: u32) -> Self {
        Self {
            tokens: f64::from(burst),
            at: Instant::now(),
        }
    }

    /// Takes a token if there is one, refilled at `rate` a second up to
    /// `burst` since the last take.
    pub(crate) fn take(&mut self, rate: u32, burst: u32, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * f64::from(rate)).min(f64::from(burst));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn tenants_are_served_in_turn_whatever_one_queued() {
        let q = TenantQueues::new(1_000);
        for n in 0..100 {
            q.push("acme", n).unwrap();
        }
        q.push("globex", 1).unwrap();
        q.push("globex", 2).unwrap();
        let order: Vec<(String, i32)> = std::iter::from_fn(|| q.try_pop()).take(5).collect();
        let tenants: Vec<&str> = order.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(tenants, ["acme", "globex", "acme", "globex", "acme"]);
        assert_eq!(order[1].1, 1);
        assert_eq!(order[3].1, 2);
        // Each tenant's own items stay in order.
        assert_eq!(order[4].1, 2);
    }

    #[test]
    fn a_full_tenant_queue_refuses_only_that_tenant() {
        let q = TenantQueues::new(2);
        q.push("acme", 1).unwrap();
        q.push("acme", 2).unwrap();
        assert_eq!(q.push("acme", 3), Err(Refused::Full));
        q.push("globex", 1).unwrap();
        assert_eq!(q.try_pop().map(|(t, _)| t).as_deref(), Some("acme"));
        q.push("acme", 3).unwrap();
    }

    #[test]
    fn the_bucket_admits_a_burst_then_the_rate() {
        let start = Instant::now();
        let mut b = TokenBucket::full(3);
        let taken = (0..10).filter(|_| b.take(2, 3, start)).count();
        assert_eq!(taken, 3);
        assert!(b.take(2, 3, start + Duration::from_millis(500)));
        assert!(!b.take(2, 3, start + Duration::from_millis(500)));
        // Never more than the burst saved up.
        let later = start + Duration::from_secs(60);
        let taken = (0..10).filter(|_| b.take(2, 3, later)).count();
        assert_eq!(taken, 3);
    }
}
