//! Whose turn it is: smooth weighted round robin over the tenants with
//! chat jobs waiting (nginx's upstream balancing; Hatchet's
//! `GROUP_ROUND_ROBIN` with weights).
//!
//! Each pick adds every waiting tenant's weight to its credit, takes the
//! tenant with the most credit (ties: the first by name) and takes the
//! sum of the weights off its credit. Over any run of picks among the
//! same tenants each gets its weight's share, spread out (weights 2 and
//! 1 give `a a b`, never `a a a a b b`). A tenant with nothing waiting
//! leaves the turns ([`Turns::idle`]) and comes back with no credit,
//! so a quiet spell earns no burst later.

use std::collections::BTreeMap;

/// The tenants with work waiting, each with its weight and credit.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    waiting: BTreeMap<String, Credit>,
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
    }

    /// Whether no tenant has work waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The tenant whose turn it is, `None` when none waits.
    pub(crate) fn next(&mut self) -> Option<String> {
        let total: i64 = self.waiting.values().map(|c| c.weight).sum();
        let mut best: Option<(&String, &mut Credit)> = None;
        for (tenant, c) in &mut self.waiting {
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
