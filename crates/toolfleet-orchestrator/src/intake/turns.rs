//! Whose turn it is: among the tenants with chat jobs waiting, those with
//! the fewest jobs running here for their weight, then smooth weighted
//! round robin among them (nginx's upstream balancing; Hatchet's
//! `GROUP_ROUND_ROBIN` with weights).
//!
//! Load first: a free slot goes to a tenant using less than its share of
//! the slots — a quiet tenant's job starts at the next free slot however
//! deep another's backlog, and flooding tenants hold slots in proportion
//! to their weights. Among the tenants of equal load (all of them when
//! one job runs at a time), each pick adds each one's weight to its
//! credit, takes the one with the most credit (ties: the first by name)
//! and takes the sum of their weights off its credit: over any run of
//! picks each gets its weight's share, spread out (weights 2 and 1 give
//! `a b a a b a`, never `a a a a b b`). A tenant with nothing waiting
//! leaves the turns ([`Turns::idle`]) and comes back with no credit, so a
//! quiet spell earns no burst later.

use std::collections::BTreeMap;

/// The tenants with work waiting, each with its weight and credit.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    waiting: BTreeMap<String, Credit>,
    /// Tenants that keep their credit but take no turn for now (a fetch of
    /// theirs is out).
    paused: std::collections::BTreeSet<String>,
}

#[derive(Debug)]
struct Credit {
    weight: i64,
    credit: i64,
}

impl Turns {
    /// `tenant` has work waiting, with `weight` (at least 1); one already
    /// waiting keeps its credit and takes the new weight.
    pub(crate) fn wake(&mut self, tenant: &str, weight: u32) {
        let weight = i64::from(weight.max(1));
        match self.waiting.get_mut(tenant) {
            Some(c) => c.weight = weight,
            None => {
                self.waiting
                    .insert(tenant.to_owned(), Credit { weight, credit: 0 });
            }
        }
    }

    /// `tenant` has nothing waiting: it takes no turn until woken.
    pub(crate) fn idle(&mut self, tenant: &str) {
        self.waiting.remove(tenant);
        self.paused.remove(tenant);
    }

    /// `tenant` takes no turn until [`Turns::resume`] (or is idled),
    /// keeping its credit.
    pub(crate) fn pause(&mut self, tenant: &str) {
        if self.waiting.contains_key(tenant) {
            self.paused.insert(tenant.to_owned());
        }
    }

    /// `tenant` takes turns again, with the credit it had.
    pub(crate) fn resume(&mut self, tenant: &str) {
        self.paused.remove(tenant);
    }

    /// Every paused tenant takes turns again.
    pub(crate) fn resume_all(&mut self) {
        self.paused.clear();
    }

    /// Whether no tenant can take a turn now.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.keys().all(|t| self.paused.contains(t))
    }

    /// The tenant whose turn it is when every tenant runs as many jobs
    /// as any other; `None` when none waits.
    #[cfg(test)]
    pub(crate) fn next(&mut self) -> Option<String> {
        self.next_by_load(|_| 0, |_| true)
    }

    /// The tenant whose turn it is among those `may_take` allows, given
    /// how many jobs each runs here (`running`); `None` when none may.
    pub(crate) fn next_by_load(
        &mut self,
        running: impl Fn(&str) -> u32,
        may_take: impl Fn(&str) -> bool,
    ) -> Option<String> {
        // Load as a fraction running / weight, compared by cross-multiplying.
        let load = |tenant: &str, c: &Credit| (i64::from(running(tenant)), c.weight);
        let paused = &self.paused;
        let out = |t: &str| paused.contains(t) || !may_take(t);
        let lightest = self
            .waiting
            .iter()
            .filter(|(t, _)| !out(t))
            .map(|(t, c)| load(t, c))
            .min_by(|(ra, wa), (rb, wb)| (ra * wb).cmp(&(rb * wa)))?;
        let least = |(r, w): (i64, i64)| r * lightest.1 == lightest.0 * w;
        let total: i64 = self
            .waiting
            .iter()
            .filter(|(t, c)| !out(t) && least(load(t, c)))
            .map(|(_, c)| c.weight)
            .sum();
        let mut best: Option<(&String, &mut Credit)> = None;
        for (tenant, c) in &mut self.waiting {
            if out(tenant) || !least((i64::from(running(tenant)), c.weight)) {
                continue;
            }
            c.credit += c.weight;
            if best.as_ref().is_none_or(|(_, b)| c.credit > b.credit) {
                best = Some((tenant, c));
            }
        }
        let (tenant, c) = best?;
        c.credit -= total;
        Some(tenant.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picks(turns: &mut Turns, n: usize) -> Vec<String> {
        (0..n).filter_map(|_| turns.next()).collect()
    }

    #[test]
    fn equal_weights_alternate() {
        let mut t = Turns::default();
        assert_eq!(t.next(), None);
        t.wake("acme", 1);
        t.wake("globex", 1);
        assert_eq!(
            picks(&mut t, 4),
            ["acme", "globex", "acme", "globex"].map(String::from)
        );
    }

    #[test]
    fn weights_give_shares_spread_out() {
        let mut t = Turns::default();
        t.wake("acme", 2);
        t.wake("globex", 1);
        assert_eq!(
            picks(&mut t, 6),
            ["acme", "globex", "acme", "acme", "globex", "acme"].map(String::from)
        );
        let mut t = Turns::default();
        t.wake("a", 5);
        t.wake("b", 3);
        t.wake("c", 1);
        let got = picks(&mut t, 900);
        for (tenant, share) in [("a", 500), ("b", 300), ("c", 100)] {
            assert_eq!(got.iter().filter(|p| *p == tenant).count(), share);
        }
    }

    #[test]
    fn a_tenant_running_less_for_its_weight_goes_first() {
        let mut t = Turns::default();
        t.wake("acme", 1);
        t.wake("globex", 1);
        // Acme runs 5 here, globex 1: globex takes every free slot.
        let running = |t: &str| if t == "acme" { 5 } else { 1 };
        for _ in 0..3 {
            assert_eq!(t.next_by_load(running, |_| true).as_deref(), Some("globex"));
        }
        // Weights 2 and 1: acme running 4 is as loaded as globex running 2.
        let mut t = Turns::default();
        t.wake("acme", 2);
        t.wake("globex", 1);
        let running = |t: &str| if t == "acme" { 4 } else { 2 };
        let got = picks_by(&mut t, 6, running);
        assert_eq!(got.iter().filter(|p| *p == "acme").count(), 4);
        let running = |t: &str| if t == "acme" { 5 } else { 2 };
        assert_eq!(t.next_by_load(running, |_| true).as_deref(), Some("globex"));
        // A tenant at its share takes no turn, whatever its load.
        assert_eq!(
            t.next_by_load(running, |t| t != "globex").as_deref(),
            Some("acme")
        );
        assert_eq!(t.next_by_load(running, |_| false), None);
    }

    fn picks_by(turns: &mut Turns, n: usize, running: impl Fn(&str) -> u32 + Copy) -> Vec<String> {
        (0..n)
            .filter_map(|_| turns.next_by_load(running, |_| true))
            .collect()
    }

    #[test]
    fn a_paused_tenant_takes_no_turn_and_keeps_its_credit() {
        let mut t = Turns::default();
        t.wake("acme", 2);
        t.wake("globex", 1);
        assert_eq!(t.next().as_deref(), Some("acme"));
        t.pause("acme");
        assert_eq!(t.next().as_deref(), Some("globex"));
        t.pause("globex");
        assert!(t.is_empty());
        assert_eq!(t.next(), None);
        t.resume("acme");
        t.resume("globex");
        // Weights 2:1 still hold across the pauses.
        let got = picks(&mut t, 6);
        assert_eq!(got.iter().filter(|p| *p == "acme").count(), 4, "{got:?}");
    }

    #[test]
    fn an_idle_tenant_takes_no_turn_and_earns_no_credit() {
        let mut t = Turns::default();
        t.wake("acme", 1);
        t.wake("globex", 1);
        t.idle("globex");
        assert_eq!(picks(&mut t, 3), ["acme", "acme", "acme"].map(String::from));
        t.wake("globex", 1);
        let got = picks(&mut t, 4);
        assert_eq!(got.iter().filter(|p| *p == "globex").count(), 2);
        assert_eq!(
            t.waiting.keys().collect::<Vec<_>>(),
            [&"acme".to_owned(), &"globex".to_owned()]
        );
        t.idle("acme");
        t.idle("globex");
        assert!(t.is_empty());
    }
}
