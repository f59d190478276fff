//! What a search asks for, what it returns, and how result lists combine.
//!
//! Both index backends answer the same [`Query`]: words to match (BM25 in
//! tantivy, `tsvector` ranking in PostgreSQL) and filters that must really
//! filter — kinds, collections, documents, owner, time range, event levels
//! and buckets, entities, ids — cut to `top_k`, always within one tenant.
//! Lists from different searches combine in two ways:
//!
//! - [`reciprocal_rank_fusion`] for lists whose scores are not comparable
//!   (BM25 and vector similarity): each item scores `Σ 1/(k + rank)`.
//! - [`merge_keep_best`] for lists of the same kind of score (knowledge and
//!   L0 events, summaries and their drill-down): de-duplicated by id keeping
//!   the higher score, sorted best first.

use std::collections::HashMap;

use crate::model::{Item, ItemKind, Level, Owner};

/// The `k` of reciprocal rank fusion: 60, as in Cormack et al. (2009),
/// damps the difference between the first few ranks.
pub const RRF_K: f32 = 60.0;

/// The most results one search returns.
pub const MAX_TOP_K: usize = 100;

/// An inclusive range of item timestamps (Unix ms); an open end is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeRange {
    pub from_ms: Option<i64>,
    pub to_ms: Option<i64>,
}

impl TimeRange {
    /// Does `ms` fall in the range?
    pub fn contains(&self, ms: i64) -> bool {
        self.from_ms.is_none_or(|f| ms >= f) && self.to_ms.is_none_or(|t| ms <= t)
    }
}

/// One search. Empty filter lists mean "any"; the callers that scope a
/// search (the retrieval tools) always set the scope filters. The tenant is
/// never "any": a backend refuses a query without a valid one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Query {
    /// The tenant whose items are searched (the invocation's); nothing of
    /// another tenant's ever matches.
    pub tenant: String,
    /// Words to match; empty for a filter-only listing, newest first.
    pub text: String,
    pub kinds: Vec<ItemKind>,
    pub collections: Vec<String>,
    pub documents: Vec<String>,
    pub owner: Owner,
    pub time: TimeRange,
    pub levels: Vec<Level>,
    /// Day, week or month keys (see [`crate::model::Buckets`]); an item
    /// passes when its bucket at its own level is one of them.
    pub buckets: Vec<String>,
    /// Normalised entity names ([`crate::model::normalize_entity`]); an
    /// item passes when it mentions every one.
    pub entities: Vec<String>,
    /// Only these item ids (a drill-down through child ids).
    pub ids: Vec<String>,
    pub top_k: usize,
    /// Rank by cosine similarity to this vector instead of by words (items
    /// without an embedding are left out); the filters still filter.
    pub vector: Option<Vec<f32>>,
}

/// The cosine similarity of two vectors (0 when either is zero or their
/// lengths differ).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() || a.is_empty() {
        return 0.0;
    }
    let (mut dot, mut na, mut nb) = (0.0f32, 0.0f32, 0.0f32);
    for (x, y) in a.iter().zip(b) {
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na.sqrt() * nb.sqrt())
    }
}

/// Whether `vector` can be searched with: non-empty, finite and not zero
/// (a zero vector has no direction, so nothing is near it).
pub fn has_direction(vector: &[f32]) -> bool {
    !vector.is_empty() && vector.iter().all(|x| x.is_finite()) && vector.iter().any(|x| *x != 0.0)
}

/// The similarity of a stored `candidate` to `query`, or `None` when they
/// do not compare (different dimensions, or a candidate without
/// direction): every backend leaves such rows out alike.
pub fn similarity(query: &[f32], candidate: &[f32]) -> Option<f32> {
    (candidate.len() == query.len() && has_direction(candidate)).then(|| cosine(query, candidate))
}

/// Keeps the `top_k` best of `scored` (higher first): a bounded heap, so a
/// brute-force vector scan holds `top_k` entries, not every candidate.
pub fn top_k_by_score<T>(
    scored: impl IntoIterator<Item = (f32, T)>,
    top_k: usize,
) -> Vec<(f32, T)> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    struct Entry<T>(f32, u64, T);
    impl<T> PartialEq for Entry<T> {
        fn eq(&self, o: &Self) -> bool {
            self.0.total_cmp(&o.0).is_eq() && self.1 == o.1
        }
    }
    impl<T> Eq for Entry<T> {}
    impl<T> PartialOrd for Entry<T> {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl<T> Ord for Entry<T> {
        // Higher score first; on a tie the earlier candidate wins.
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
        }
    }
    let mut heap: BinaryHeap<Reverse<Entry<T>>> = BinaryHeap::with_capacity(top_k + 1);
    for (n, (score, value)) in scored.into_iter().enumerate() {
        heap.push(Reverse(Entry(score, n as u64, value)));
        if heap.len() > top_k {
            heap.pop();
        }
    }
    let mut out: Vec<Entry<T>> = heap.into_iter().map(|Reverse(e)| e).collect();
    out.sort_by(|a, b| b.cmp(a));
    out.into_iter().map(|Entry(s, _, v)| (s, v)).collect()
}

/// One result.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    pub item: Item,
    /// Higher is better; comparable within one list only.
    pub score: f32,
}

/// Fuses ranked lists by reciprocal rank: an item at rank `r` (from 1) of a
/// list adds `1 / (RRF_K + r)` to its score. Returns at most `top_k` hits,
/// best first; ties keep the order of first appearance.
pub fn reciprocal_rank_fusion(lists: &[Vec<Hit>], top_k: usize) -> Vec<Hit> {
    let mut fused: Vec<Hit> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for list in lists {
        for (rank, hit) in list.iter().enumerate() {
            let add = 1.0 / (RRF_K + rank as f32 + 1.0);
            match at.get(&hit.item.id) {
                Some(&i) => fused[i].score += add,
                None => {
                    at.insert(hit.item.id.clone(), fused.len());
                    fused.push(Hit {
                        item: hit.item.clone(),
                        score: add,
                    });
                }
            }
        }
    }
    sort_best_first(&mut fused);
    fused.truncate(top_k);
    fused
}

/// Merges lists of comparable scores: one hit per id, the higher score
/// kept, best first, at most `top_k`.
pub fn merge_keep_best(lists: impl IntoIterator<Item = Vec<Hit>>, top_k: usize) -> Vec<Hit> {
    let mut merged: Vec<Hit> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for hit in lists.into_iter().flatten() {
        match at.get(&hit.item.id) {
            Some(&i) => {
                if hit.score > merged[i].score {
                    merged[i] = hit;
                }
            }
            None => {
                at.insert(hit.item.id.clone(), merged.len());
                merged.push(hit);
            }
        }
    }
    sort_best_first(&mut merged);
    merged.truncate(top_k);
    merged
}

/// Stable sort by score, descending (NaN last).
fn sort_best_first(hits: &mut [Hit]) {
    hits.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or_else(|| a.score.is_nan().cmp(&b.score.is_nan()))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(id: &str, score: f32) -> Hit {
        Hit {
            item: Item {
                id: id.into(),
                kind: ItemKind::Knowledge,
                collection: "c".into(),
                document_id: None,
                chunk: None,
                title: id.into(),
                text: String::new(),
                source: None,
                owner: Owner::default(),
                timestamp_ms: 0,
                ingested_ms: 0,
                entities: vec![],
                level: None,
                child_ids: vec![],
                aliases: vec![],
                relations: vec![],
                embedding: None,
            },
            score,
        }
    }

    fn ids(hits: &[Hit]) -> Vec<&str> {
        hits.iter().map(|h| h.item.id.as_str()).collect()
    }

    #[test]
    fn fusion_rewards_items_both_lists_rank() {
        let bm25 = vec![hit("a", 9.0), hit("b", 5.0), hit("c", 1.0)];
        let vector = vec![hit("b", 0.9), hit("d", 0.8), hit("a", 0.7)];
        let fused = reciprocal_rank_fusion(&[bm25, vector], 10);
        // b: 1/62 + 1/61; a: 1/61 + 1/63; d: 1/62; c: 1/63.
        assert_eq!(ids(&fused), ["b", "a", "d", "c"]);
        let b = 1.0 / 62.0 + 1.0 / 61.0;
        assert!((fused[0].score - b).abs() < 1e-6);
        assert_eq!(reciprocal_rank_fusion(&[vec![hit("a", 1.0)]], 0), vec![]);
        assert_eq!(ids(&reciprocal_rank_fusion(&[], 3)), Vec::<&str>::new());
    }

    #[test]
    fn merging_keeps_the_higher_score_per_id() {
        let merged = merge_keep_best(
            [
                vec![hit("a", 0.2), hit("b", 0.9)],
                vec![hit("a", 0.7), hit("c", 0.1)],
            ],
            10,
        );
        assert_eq!(ids(&merged), ["b", "a", "c"]);
        assert!((merged[1].score - 0.7).abs() < 1e-6);
        assert_eq!(
            ids(&merge_keep_best([vec![hit("a", 1.0), hit("b", 2.0)]], 1)),
            ["b"]
        );
    }

    #[test]
    fn nan_scores_sort_last() {
        let merged = merge_keep_best([vec![hit("n", f32::NAN), hit("a", 0.1)]], 10);
        assert_eq!(ids(&merged), ["a", "n"]);
    }

    #[test]
    fn time_ranges_are_inclusive_and_may_be_open() {
        let r = TimeRange {
            from_ms: Some(10),
            to_ms: Some(20),
        };
        assert!(r.contains(10) && r.contains(20) && !r.contains(9) && !r.contains(21));
        assert!(TimeRange::default().contains(i64::MIN));
        let open = TimeRange {
            from_ms: Some(5),
            to_ms: None,
        };
        assert!(open.contains(i64::MAX) && !open.contains(4));
    }
}
