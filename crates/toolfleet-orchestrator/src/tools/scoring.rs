//! Progressive tool scoping: which of the permitted tools the model is
//! offered when a fleet serves more than it can read. Pure, synchronous
//! functions (no NATS, no HTTP, no clock); the invocation build and the
//! round loop call them and publish what they decide.
//!
//! # The decision
//!
//! With `P` permitted tools and the profile's [`ScopingPolicy`]
//! ([`stage`] tells which applies):
//!
//! 1. `P <= scoping_threshold`: every permitted tool is offered.
//! 2. Otherwise the **relevance** selection ([`by_relevance`]): the
//!    must-include tools, then the `initial_tool_count` permitted tools
//!    most relevant to the conversation ([`scoring_query`]: the latest user
//!    message and the last assistant message), then — beyond that count —
//!    any tool whose relevance reaches its own `recommended_threshold`.
//!    Only tools that score above 0 are picked by relevance; when no
//!    permitted tool scores at all, the first `initial_tool_count` in
//!    tool-id order are offered instead (a stable, explainable choice
//!    rather than an empty offer).
//! 3. `P > planning_threshold`: a **planning** call to the profile's
//!    utility model ([`planning_messages`]) sees the recent conversation,
//!    the best candidates by relevance and the categories, and answers
//!    `{"tools": [...], "categories": [...]}` ([`parse_plan`]);
//!    [`apply_plan`] turns that into the offer. A failed or unusable plan
//!    leaves the relevance selection in place.
//! 4. When tools were left out, the model is also offered
//!    [`SEARCH_TOOLS`] ([`search_tools_spec`]); [`run_search_tools`] (or
//!    [`run_search_tools_in`], with the snapshot's index) adds what it
//!    finds, within the room left under `max_tool_count`, at most
//!    `max_expansion_rounds` times (the caller counts).
//! 5. A call to a tool that is not offered is answered with close names
//!    ([`suggest`]).
//!
//! # Relevance
//!
//! [`RelevanceIndex`] is built once per catalog snapshot. Each tool's text
//! is cut into tokens ([`tokens`]) in four fields, weighted
//! names 4 (namespace, tool name, function name), tags 3 (tags and the
//! category), parameters 2 (keys of `function.parameters.properties`),
//! descriptions 1 (title, description, function description). A token's
//! weight is its inverse document frequency, `ln(1 + N / df)`, so a word
//! every tool has counts for little. A tool's relevance to a query is, per
//! field, the idf-weighted share of the field's distinct tokens the query
//! mentions, averaged over the fields the tool has with the weights above:
//! 1.0 means the query mentions every token of every field. For example
//! (a catalog of 53 tools), `get_weather` (tags `forecast`, `weather`;
//! parameters `city`, `date`) scores 0.26 for "What's the weather like in
//! Paris?" and 0.51 for "get the weather forecast for Lyon tomorrow";
//! `send_email` scores 0.46 for "send an email to Bob"; one word of a
//! tool's name alone gives roughly 0.15–0.3, several 0.4–0.6.
//! The scale does not depend on the length of the query or on the other
//! tools' scores, which is what makes a definition's
//! `recommended_threshold` (in `0..=1`) comparable to it.
//!
//! # Invariants
//!
//! - Must-include tools are always chosen, even past `max_tool_count`;
//!   otherwise a selection never holds more than `max_tool_count` tools.
//! - A selection never holds a tool twice, nor a position outside the
//!   index, and picks only among the candidates it is given (a
//!   must-include tool is the caller's decision and is not checked).
//! - Results are deterministic: equal relevance is ordered by tool id.
//! - Nothing here panics on what a model or a definition says.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde_json::{Map, Value, json};
use toolfleet_config::ScopingPolicy;
use toolfleet_llm::{Message, ToolSpec};
use toolfleet_protocol::search;
use toolfleet_protocol::tools::{CompiledTool, ToolDefinition, ToolId};

// ---------------------------------------------------------------------------
// Stages

/// Which scoping applies to a number of permitted tools (see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Up to `scoping_threshold`: every permitted tool is offered.
    All,
    /// Above it: the relevance selection.
    Relevance,
    /// Above `planning_threshold`: a planning call narrows the set.
    Planning,
}

/// The stage for `permitted` tools under `policy`: planning above the
/// planning threshold, or above the scoping threshold when imported MCP
/// tools are among them (`mcp`: their names and descriptions are a
/// stranger's, so relevance by words is a poor guide).
#[must_use]
pub fn stage(permitted: usize, mcp: bool, policy: &ScopingPolicy) -> Stage {
    if permitted <= policy.scoping_threshold {
        Stage::All
    } else if permitted <= policy.planning_threshold && !mcp {
        Stage::Relevance
    } else {
        Stage::Planning
    }
}

// ---------------------------------------------------------------------------
// Tokens

/// Words too common to tell tools apart, and the pieces contractions
/// leave (`I'll` → `ll`), sorted (binary-searched).
const STOP_WORDS: &[&str] = &[
    "about", "after", "all", "also", "am", "an", "and", "any", "are", "aren", "as", "at", "be",
    "been", "before", "being", "but", "by", "can", "could", "couldn", "did", "didn", "do", "does",
    "doesn", "don", "for", "from", "had", "has", "hasn", "have", "haven", "he", "her", "here",
    "him", "his", "how", "if", "in", "into", "is", "isn", "it", "its", "just", "let", "ll", "me",
    "my", "no", "not", "of", "on", "or", "our", "please", "re", "she", "should", "shouldn", "so",
    "some", "than", "that", "the", "their", "them", "then", "there", "these", "they", "this",
    "those", "to", "too", "up", "us", "ve", "very", "was", "wasn", "we", "were", "what", "when",
    "where", "which", "while", "who", "why", "will", "with", "won", "would", "wouldn", "you",
    "your",
];

/// The tokens of `text`, in order (repeats kept): lowercased, split on
/// anything not alphanumeric and at camelCase humps (`getHTTPStatus` →
/// `get`, `http`, `status`; snake_case splits at `_`), without stop words
/// or one-character tokens, plurals lightly folded (`queries` → `query`,
/// `files` → `file`, `addresses` → `address`; `status` stays).
#[must_use]
pub fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for_each_token(text, |t| out.push(t.to_owned()));
    out
}

/// Calls `emit` with each token of `text` (see [`tokens`]), reusing one
/// buffer so that indexing allocates only for new words.
fn for_each_token(text: &str, mut emit: impl FnMut(&str)) {
    let mut word = String::new();
    let mut prev: Option<char> = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if !c.is_alphanumeric() {
            finish_word(&mut word, &mut emit);
            prev = None;
            continue;
        }
        if let Some(p) = prev {
            // `fooBar`, `utf8Text`: a hump; `HTTPServer`: the last capital
            // of a run starts the next word.
            let hump = (p.is_lowercase() || p.is_numeric()) && c.is_uppercase();
            let acronym_end = p.is_uppercase()
                && c.is_uppercase()
                && chars.peek().is_some_and(|n| n.is_lowercase());
            if hump || acronym_end {
                finish_word(&mut word, &mut emit);
            }
        }
        if c.is_ascii() {
            word.push(c.to_ascii_lowercase());
        } else {
            word.extend(c.to_lowercase());
        }
        prev = Some(c);
    }
    finish_word(&mut word, &mut emit);
}

fn finish_word(word: &mut String, emit: &mut impl FnMut(&str)) {
    if !word.is_empty() && STOP_WORDS.binary_search(&word.as_str()).is_err() {
        singular(word);
        if word.chars().nth(1).is_some() {
            emit(word);
        }
    }
    word.clear();
}

/// Folds a plural to its singular in place, for words over 3 bytes; the
/// suffixes are ASCII, so cutting bytes keeps the string valid.
fn singular(word: &mut String) {
    let len = word.len();
    if len <= 3 {
        return;
    }
    if len > 4 && word.ends_with("ies") {
        word.truncate(len - 3);
        word.push('y');
    } else if word.ends_with("sses")
        || word.ends_with("xes")
        || word.ends_with("ches")
        || word.ends_with("shes")
    {
        word.truncate(len - 2);
    } else if word.ends_with('s')
        && !word.ends_with("ss")
        && !word.ends_with("us")
        && !word.ends_with("is")
    {
        word.truncate(len - 1);
    }
}

// ---------------------------------------------------------------------------
// The relevance index

/// Token fields, highest weight first.
const NAME: usize = 0;
const TAG: usize = 1;
const PARAMETER: usize = 2;
const DESCRIPTION: usize = 3;
const FIELDS: usize = 4;
/// Weight of each field in a tool's relevance (see the module docs).
const FIELD_WEIGHTS: [f32; FIELDS] = [4.0, 3.0, 2.0, 1.0];

/// Postings pack a tool position and a 4-bit field mask into one `u32`;
/// tools at positions from here on are not indexed (they never score).
const MAX_INDEXED: usize = 1 << 28;
const FIELD_BITS: u32 = 4;
const FIELD_MASK: u32 = (1 << FIELD_BITS) - 1;

/// A multiply-rotate hasher (FxHash's) for the vocabulary: several times
/// cheaper than SipHash on short words, and the index is built for every
/// catalog swap. Flooding is no concern here: only definitions (the
/// fleet's own workers) insert words; a query only looks words up.
#[derive(Default, Clone, Copy)]
struct WordHasher(u64);

impl std::hash::Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

type Vocabulary = HashMap<Box<str>, u32, std::hash::BuildHasherDefault<WordHasher>>;

/// The tools of one catalog snapshot with an inverted index token →
/// tools, so that scoring a query touches only the tools sharing a token
/// with it. Immutable; build a new one when the catalog changes.
/// Positions are indices into the slice it was built from.
pub struct RelevanceIndex {
    tools: Vec<Arc<CompiledTool>>,
    /// Token → token number.
    vocabulary: Vocabulary,
    /// Per token number: `ln(1 + N / df)`.
    idf: Vec<f32>,
    /// Per token number `t`, its postings are
    /// `postings[offsets[t]..offsets[t + 1]]`, by position.
    offsets: Vec<u32>,
    /// `position << FIELD_BITS | field mask`.
    postings: Vec<u32>,
    /// Per tool, per field: the idf sum of its distinct tokens (0: the
    /// tool has nothing in that field).
    field_totals: Vec<[f32; FIELDS]>,
    /// Positions in tool-id order.
    by_id: Vec<u32>,
    /// Per position, its rank in tool-id order (ties in relevance).
    id_rank: Vec<u32>,
    /// Positions in function-name order.
    by_function: Vec<u32>,
    /// Per position, its category's number in `category_names`.
    category: Vec<u32>,
    category_names: Vec<String>,
}

impl std::fmt::Debug for RelevanceIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelevanceIndex")
            .field("tools", &self.tools.len())
            .field("tokens", &self.idf.len())
            .field("postings", &self.postings.len())
            .finish_non_exhaustive()
    }
}

/// A tool's relevance to a query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    /// The tool's position in the index.
    pub position: usize,
    /// In `0..=1` (see the module docs); above 0 in every result.
    pub relevance: f64,
}

impl RelevanceIndex {
    /// Indexes `tools` (the catalog snapshot, typically every offered
    /// tool). Cost is linear in the text of the definitions.
    #[must_use]
    pub fn build(tools: &[Arc<CompiledTool>]) -> RelevanceIndex {
        let n = tools.len();
        let mut vocabulary = Vocabulary::default();
        // (token, packed posting), in position order.
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(n * 32);
        let mut one_tool: Vec<(u32, u32)> = Vec::new();
        for (position, tool) in tools.iter().enumerate().take(MAX_INDEXED) {
            let Ok(packed) = u32::try_from(position) else {
                continue;
            };
            one_tool.clear();
            tool_tokens(&mut vocabulary, &mut one_tool, &tool.definition);
            // One posting per distinct token, its fields OR-ed together.
            one_tool.sort_unstable_by_key(|&(token, _)| token);
            for group in one_tool.chunk_by(|a, b| a.0 == b.0) {
                let mask = group.iter().fold(0, |mask, &(_, field)| mask | field);
                pairs.push((group[0].0, packed << FIELD_BITS | mask));
            }
        }
        let grouped = Postings::group(&pairs, vocabulary.len(), n);
        drop(pairs);
        vocabulary.shrink_to_fit();
        let (category, category_names) = categories(tools);
        let (by_id, id_rank, by_function) = orders(tools);
        RelevanceIndex {
            tools: tools.to_vec(),
            vocabulary,
            idf: grouped.idf,
            offsets: grouped.offsets,
            postings: grouped.postings,
            field_totals: grouped.field_totals,
            by_id,
            id_rank,
            by_function,
            category,
            category_names,
        }
    }

    /// How many tools the index holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The tools, by position.
    #[must_use]
    pub fn tools(&self) -> &[Arc<CompiledTool>] {
        &self.tools
    }

    /// The tool at `position`.
    #[must_use]
    pub fn tool(&self, position: usize) -> Option<&Arc<CompiledTool>> {
        self.tools.get(position)
    }

    /// How many distinct tokens the index knows.
    #[must_use]
    pub fn vocabulary_len(&self) -> usize {
        self.vocabulary.len()
    }

    /// The position of the tool a model or a plan names: by function name
    /// (exact, then ignoring case), by full id (`ns:name@x.y.z`), or by
    /// `ns:name` (its highest version). Where several tools share the name
    /// (versions of one tool during a rolling upgrade), the one with the
    /// highest version of the smallest `ns:name` wins.
    #[must_use]
    pub fn position(&self, name: &str) -> Option<usize> {
        self.position_among(name, |_| true)
    }

    /// [`position`](Self::position) among the `allowed` positions only: a
    /// name shared by a tool the invocation may not use and one it may
    /// resolves to the latter.
    #[must_use]
    pub fn position_among(&self, name: &str, allowed: impl Fn(usize) -> bool) -> Option<usize> {
        let name = name.trim();
        let function = |p: &u32| self.tools[*p as usize].definition.function.name.as_str();
        // Among tools sharing a function name: the smallest ns:name, its
        // highest version.
        let best = |found: &mut dyn Iterator<Item = usize>| {
            found.min_by(|&a, &b| {
                let (a, b) = (&self.tools[a].definition.id, &self.tools[b].definition.id);
                (&a.namespace, &a.name)
                    .cmp(&(&b.namespace, &b.name))
                    .then(b.version.cmp(&a.version))
            })
        };
        let start = self.by_function.partition_point(|p| function(p) < name);
        let exact = best(
            &mut self.by_function[start..]
                .iter()
                .take_while(|p| function(p) == name)
                .map(|p| *p as usize)
                .filter(|&p| allowed(p)),
        );
        if exact.is_some() {
            return exact;
        }
        if let Ok(id) = name.parse::<ToolId>() {
            let start = self
                .by_id
                .partition_point(|p| self.tools[*p as usize].definition.id < id);
            return self
                .by_id
                .get(start)
                .filter(|p| self.tools[**p as usize].definition.id == id)
                .map(|p| *p as usize)
                .filter(|&p| allowed(p));
        }
        if let Some((namespace, tool)) = name.split_once(':') {
            return self.by_id.iter().rev().map(|p| *p as usize).find(|&p| {
                let id = &self.tools[p].definition.id;
                id.namespace == namespace && id.name == tool && allowed(p)
            });
        }
        best(
            &mut self.by_function.iter().map(|p| *p as usize).filter(|&p| {
                self.tools[p]
                    .definition
                    .function
                    .name
                    .eq_ignore_ascii_case(name)
                    && allowed(p)
            }),
        )
    }

    /// The categories of the allowed tools with how many each has, the
    /// largest first (ties by name).
    #[must_use]
    pub fn categories(&self, allowed: impl Fn(usize) -> bool) -> Vec<(String, usize)> {
        let mut counts = vec![0usize; self.category_names.len()];
        for (position, &number) in self.category.iter().enumerate() {
            if allowed(position) {
                counts[number as usize] += 1;
            }
        }
        let mut out: Vec<(String, usize)> = counts
            .into_iter()
            .enumerate()
            .filter(|&(_, count)| count > 0)
            .map(|(number, count)| (self.category_names[number].clone(), count))
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// The allowed tools sharing a token with `query`, most relevant
    /// first, equal relevance in tool-id order. Tools that share nothing
    /// are left out.
    #[must_use]
    pub fn score(&self, query: &str, allowed: impl Fn(usize) -> bool) -> Vec<Scored> {
        let mut query_tokens: Vec<u32> = Vec::new();
        for_each_token(query, |token| {
            if let Some(&number) = self.vocabulary.get(token) {
                query_tokens.push(number);
            }
        });
        query_tokens.sort_unstable();
        query_tokens.dedup();
        if query_tokens.is_empty() {
            return Vec::new();
        }
        // Dense accumulators (zeroed memory, so cheap to get); only the
        // touched tools are read back.
        let mut matched = vec![[0f32; FIELDS]; self.tools.len()];
        let mut touched: Vec<u32> = Vec::new();
        for token in query_tokens {
            let t = token as usize;
            let idf = self.idf[t];
            let range = self.offsets[t] as usize..self.offsets[t + 1] as usize;
            for &posting in &self.postings[range] {
                let position = posting >> FIELD_BITS;
                let sums = &mut matched[position as usize];
                if *sums == [0.0; FIELDS] {
                    touched.push(position);
                }
                for (field, sum) in sums.iter_mut().enumerate() {
                    if posting & FIELD_MASK & (1 << field) != 0 {
                        *sum += idf;
                    }
                }
            }
        }
        let mut scored: Vec<Scored> = touched
            .into_iter()
            .map(|p| p as usize)
            .filter(|&p| allowed(p))
            .map(|position| Scored {
                position,
                relevance: self.relevance(position, &matched[position]),
            })
            .filter(|s| s.relevance > 0.0)
            .collect();
        scored.sort_by(|a, b| {
            b.relevance
                .total_cmp(&a.relevance)
                .then_with(|| self.id_rank[a.position].cmp(&self.id_rank[b.position]))
        });
        scored
    }

    fn relevance(&self, position: usize, matched: &[f32; FIELDS]) -> f64 {
        let totals = &self.field_totals[position];
        let (mut sum, mut weights) = (0f32, 0f32);
        for field in 0..FIELDS {
            if totals[field] > 0.0 {
                weights += FIELD_WEIGHTS[field];
                sum += FIELD_WEIGHTS[field] * (matched[field] / totals[field]).min(1.0);
            }
        }
        if weights > 0.0 {
            f64::from(sum / weights).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Positions ordered for a selection: by rank in `ranked` (relevance),
    /// then unscored ones by tool id.
    fn order_key(&self, rank: &[u32], position: usize) -> (u32, u32) {
        (rank[position], self.id_rank[position])
    }
}

/// The text tools are scored against: the latest user message, then the
/// last assistant message (its text and the names of the tools it
/// called).
#[must_use]
pub fn scoring_query(messages: &[Message]) -> String {
    let user = messages.iter().rev().find_map(|m| match m {
        Message::User { content } => Some(content.as_str()),
        _ => None,
    });
    let assistant = messages.iter().rev().find_map(|m| match m {
        Message::Assistant {
            content,
            tool_calls,
            ..
        } => Some((content.as_deref().unwrap_or(""), tool_calls)),
        _ => None,
    });
    let mut query = user.unwrap_or("").to_owned();
    if let Some((text, calls)) = assistant {
        for part in std::iter::once(text).chain(calls.iter().map(|c| c.name.as_str())) {
            if !part.is_empty() {
                query.push('\n');
                query.push_str(part);
            }
        }
    }
    query
}

// ---------------------------------------------------------------------------
// Selections

/// The tools to offer, by position in the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Must-include tools first (in the order given), then the rest by
    /// relevance (ties by tool id).
    pub chosen: Vec<usize>,
    /// Allowed tools not chosen: when above 0, offer [`SEARCH_TOOLS`].
    pub left_out: usize,
    /// Tool names a plan gave that are not allowed tools (for an event).
    pub unknown: Vec<String>,
    /// Category names a plan gave that no allowed tool has.
    pub unknown_categories: Vec<String>,
}

/// `candidates` as a mask over the index's positions (positions outside
/// it are dropped): pass `|p| mask[p]` to [`RelevanceIndex::score`]
/// rather than a `contains` over a list, which costs a scan per tool.
#[must_use]
pub fn candidate_mask(len: usize, candidates: &[usize]) -> Vec<bool> {
    let mut mask = vec![false; len];
    for &position in candidates {
        if let Some(slot) = mask.get_mut(position) {
            *slot = true;
        }
    }
    mask
}

/// Builds a selection: must-include tools first, then picks while there
/// is room under `max_tool_count`.
struct Builder<'a> {
    candidates: &'a [bool],
    taken: Vec<bool>,
    chosen: Vec<usize>,
    max: usize,
}

impl<'a> Builder<'a> {
    fn new(candidates: &'a [bool], must_include: &[usize], policy: &ScopingPolicy) -> Self {
        let mut builder = Builder {
            candidates,
            taken: vec![false; candidates.len()],
            chosen: Vec::new(),
            max: policy.max_tool_count,
        };
        for &position in must_include {
            if position < candidates.len() && !builder.taken[position] {
                builder.taken[position] = true;
                builder.chosen.push(position);
            }
        }
        builder
    }

    fn full(&self) -> bool {
        self.chosen.len() >= self.max
    }

    /// Adds the candidate `position` if there is room and it is new; true
    /// when added.
    fn add(&mut self, position: usize) -> bool {
        if self.full() || !self.candidates.get(position).copied().unwrap_or(false) {
            return false;
        }
        if self.taken[position] {
            return false;
        }
        self.taken[position] = true;
        self.chosen.push(position);
        true
    }

    fn finish(self) -> Selection {
        let left_out = self
            .candidates
            .iter()
            .zip(&self.taken)
            .filter(|&(&candidate, &taken)| candidate && !taken)
            .count();
        Selection {
            chosen: self.chosen,
            left_out,
            unknown: Vec::new(),
            unknown_categories: Vec::new(),
        }
    }
}

/// The relevance selection for `query` among `candidates` (positions of
/// the permitted tools): scores them and calls [`select_ranked`].
#[must_use]
pub fn by_relevance(
    index: &RelevanceIndex,
    candidates: &[usize],
    query: &str,
    policy: &ScopingPolicy,
    must_include: &[usize],
) -> Selection {
    let mask = candidate_mask(index.len(), candidates);
    let ranked = index.score(query, |p| mask[p]);
    select(index, &mask, &ranked, policy, must_include)
}

/// The relevance selection from an existing ranking (`ranked`, as
/// [`RelevanceIndex::score`] returns it) among `candidates`:
///
/// 1. the must-include tools, always (they count toward `max_tool_count`
///    but are never dropped for it, and need not be candidates);
/// 2. the `initial_tool_count` best candidates of `ranked` on top of
///    them (so up to `must + initial` tools), never past `max_tool_count`;
/// 3. beyond those, while under `max_tool_count`, every further ranked
///    candidate whose relevance is at least its own
///    `recommended_threshold`;
/// 4. only if no candidate scored at all: the first `initial_tool_count`
///    candidates in tool-id order instead of 2–3, so the model is never
///    offered nothing for want of a word in common.
#[must_use]
pub fn select_ranked(
    index: &RelevanceIndex,
    candidates: &[usize],
    ranked: &[Scored],
    policy: &ScopingPolicy,
    must_include: &[usize],
) -> Selection {
    let mask = candidate_mask(index.len(), candidates);
    select(index, &mask, ranked, policy, must_include)
}

fn select(
    index: &RelevanceIndex,
    mask: &[bool],
    ranked: &[Scored],
    policy: &ScopingPolicy,
    must_include: &[usize],
) -> Selection {
    let mut builder = Builder::new(mask, must_include, policy);
    let initial = policy.initial_tool_count;
    let scoring: Vec<&Scored> = ranked
        .iter()
        .filter(|s| s.relevance > 0.0 && mask.get(s.position).copied().unwrap_or(false))
        .collect();
    if scoring.is_empty() {
        let mut picked = 0;
        for &position in &index.by_id {
            if picked == initial || builder.full() {
                break;
            }
            if builder.add(position as usize) {
                picked += 1;
            }
        }
        return builder.finish();
    }
    let mut picked = 0;
    let mut rest = scoring.len();
    for (i, s) in scoring.iter().enumerate() {
        if picked == initial || builder.full() {
            rest = i;
            break;
        }
        if builder.add(s.position) {
            picked += 1;
        }
    }
    for s in &scoring[rest..] {
        if builder.full() {
            break;
        }
        let threshold = index
            .tool(s.position)
            .and_then(|t| t.definition.recommended_threshold);
        if threshold.is_some_and(|t| s.relevance >= t) {
            builder.add(s.position);
        }
    }
    builder.finish()
}

// ---------------------------------------------------------------------------
// Planning

/// The first line of the planning call's user message (how logs, tests
/// and the scripted model tell a planning call from a conversation call).
pub const PLANNING_MARKER: &str = "[toolfleet:tool-planning]";
/// The most candidate tools a planning call lists.
pub const MAX_PLANNING_CANDIDATES: usize = 100;
/// Characters kept of a user or assistant message in a planning call.
const PLANNING_MESSAGE_CHARS: usize = 600;
/// Characters kept of a tool result in a planning call.
const PLANNING_TOOL_RESULT_CHARS: usize = 160;
/// Characters kept of a candidate's description in a planning call.
const PLANNING_DESCRIPTION_CHARS: usize = 100;

/// The planning call's built-in instructions; a profile's
/// `planning_prompt` replaces them. `{max_tools}` becomes the policy's
/// `max_tool_count`.
pub const PLANNING_PROMPT: &str = "You choose the tools an assistant is offered for the next step of a conversation. \
     Answer with one JSON object and nothing else: \
     {\"tools\": [\"<function name>\", ...], \"categories\": [\"<category>\", ...]}. \
     Name at most {max_tools} tools, only from the candidates listed, the ones the conversation \
     needs now or next. Name a category only when many of its tools may be needed. \
     At least one of the two lists must not be empty.";

/// The messages of a planning call to the utility model: instructions,
/// then one user message starting with [`PLANNING_MARKER`] holding the
/// last `planning_history_message_count` messages of `history` (system
/// messages left out, tool results abbreviated), the `candidates` (at most
/// [`MAX_PLANNING_CANDIDATES`]; pass the best by relevance) and the
/// `categories` with their tool counts ([`RelevanceIndex::categories`]).
#[must_use]
pub fn planning_messages(
    history: &[Message],
    candidates: &[&CompiledTool],
    categories: &[(String, usize)],
    policy: &ScopingPolicy,
    template: Option<&str>,
) -> Vec<Message> {
    let system = template
        .unwrap_or(PLANNING_PROMPT)
        .replace("{max_tools}", &policy.max_tool_count.to_string());
    let recent: Vec<&Message> = history
        .iter()
        .filter(|m| !matches!(m, Message::System { .. }))
        .collect();
    let recent = &recent[recent
        .len()
        .saturating_sub(policy.planning_history_message_count)..];
    let mut user = format!(
        "{PLANNING_MARKER}\nConversation (last {} messages, oldest first):\n",
        recent.len()
    );
    for message in recent {
        let line = match message {
            Message::System { .. } => continue,
            Message::User { content } => {
                format!("user: {}", compact(content, PLANNING_MESSAGE_CHARS))
            }
            Message::Assistant {
                content,
                tool_calls,
                ..
            } => {
                let mut line = format!(
                    "assistant: {}",
                    compact(content.as_deref().unwrap_or(""), PLANNING_MESSAGE_CHARS)
                );
                if !tool_calls.is_empty() {
                    let names: Vec<&str> = tool_calls.iter().map(|c| c.name.as_str()).collect();
                    line.push_str(&format!(" [called: {}]", names.join(", ")));
                }
                line
            }
            Message::Tool { content, .. } => {
                format!("tool: {}", compact(content, PLANNING_TOOL_RESULT_CHARS))
            }
        };
        user.push_str(&line);
        user.push('\n');
    }
    user.push_str("Candidate tools (function name: what it does):\n");
    for tool in candidates.iter().take(MAX_PLANNING_CANDIDATES) {
        let f = &tool.definition.function;
        user.push_str(&format!(
            "- {}: {}\n",
            f.name,
            compact(first_sentence(&f.description), PLANNING_DESCRIPTION_CHARS)
        ));
    }
    if !categories.is_empty() {
        user.push_str("Categories (tools in each):\n");
        for (name, count) in categories {
            user.push_str(&format!("- {name} ({count})\n"));
        }
    }
    vec![
        Message::System { content: system },
        Message::User { content: user },
    ]
}

/// The utility model's answer to a planning call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Tools by function name or id, as the model wrote them (trimmed,
    /// without repeats).
    pub tools: Vec<String>,
    /// Category names, as the model wrote them.
    pub categories: Vec<String>,
}

/// Why a planning answer is unusable. The caller keeps the relevance
/// selection and may report the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the planning answer holds no JSON object: {answer:?}")]
    NoJson { answer: String },
    #[error("the planning answer names no tools and no categories: {answer:?}")]
    Empty { answer: String },
}

/// Characters of a bad answer quoted in a [`PlanError`].
const QUOTED_ANSWER_CHARS: usize = 200;

/// Reads a planning answer: the first JSON object in `text` with a
/// `tools` or `categories` key (code fences and prose around it are
/// ignored; a lone string is taken for a one-element list, non-strings
/// are skipped).
///
/// # Errors
///
/// [`PlanError::NoJson`] when `text` holds no JSON object,
/// [`PlanError::Empty`] when it names neither a tool nor a category.
pub fn parse_plan(text: &str) -> Result<Plan, PlanError> {
    let answer = || compact(text, QUOTED_ANSWER_CHARS);
    let mut first = None;
    let mut found = None;
    // Each `{` may open the object; a few dozen tries bound the work on a
    // long answer full of braces.
    for (start, _) in text.match_indices('{').take(64) {
        let mut values = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        if let Some(Ok(Value::Object(object))) = values.next() {
            if object.contains_key("tools") || object.contains_key("categories") {
                found = Some(object);
                break;
            }
            first.get_or_insert(object);
        }
    }
    let Some(object) = found.or(first) else {
        return Err(PlanError::NoJson { answer: answer() });
    };
    let plan = Plan {
        tools: string_list(&object, "tools"),
        categories: string_list(&object, "categories"),
    };
    if plan.tools.is_empty() && plan.categories.is_empty() {
        return Err(PlanError::Empty { answer: answer() });
    }
    Ok(plan)
}

fn string_list(object: &Map<String, Value>, key: &str) -> Vec<String> {
    let items: Vec<&Value> = match object.get(key) {
        Some(Value::Array(items)) => items.iter().collect(),
        Some(one @ Value::String(_)) => vec![one],
        _ => Vec::new(),
    };
    let mut seen = HashSet::new();
    items
        .into_iter()
        .filter_map(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty() && seen.insert(*s))
        .map(str::to_owned)
        .collect()
}

/// The selection a plan makes among `candidates`: the must-include
/// tools, then the tools it names (by function name or id) in relevance
/// order, then the tools of the categories it names in relevance order
/// (unscored ones by tool id), capped at `max_tool_count` (must-include
/// tools are never dropped). Named tools go before category tools: an
/// explicit pick is the stronger signal, and a large category must not
/// crowd it out. `ranked` is the relevance ranking of the candidates
/// ([`RelevanceIndex::score`]).
///
/// Names that are not candidates, and categories no candidate has, are
/// ignored and listed in [`Selection::unknown`] and
/// [`Selection::unknown_categories`]. A plan that resolves to no candidate
/// at all leaves only the must-include tools: the caller then falls back
/// to [`by_relevance`] and says why.
#[must_use]
pub fn apply_plan(
    plan: &Plan,
    index: &RelevanceIndex,
    candidates: &[usize],
    ranked: &[Scored],
    policy: &ScopingPolicy,
    must_include: &[usize],
) -> Selection {
    let mask = candidate_mask(index.len(), candidates);
    let mut unknown = Vec::new();
    let mut named = Vec::new();
    for name in &plan.tools {
        match index.position_among(name, |p| mask[p]) {
            Some(position) => named.push(position),
            None => unknown.push(name.clone()),
        }
    }
    let mut wanted = vec![false; index.category_names.len()];
    let mut unknown_categories = Vec::new();
    for name in &plan.categories {
        let number = index
            .category_names
            .iter()
            .position(|c| c.eq_ignore_ascii_case(name.trim()));
        match number {
            Some(number) => wanted[number] = true,
            None => unknown_categories.push(name.clone()),
        }
    }
    let mut in_categories: Vec<usize> = (0..index.len())
        .filter(|&p| mask[p] && wanted[index.category[p] as usize])
        .collect();
    // A category none of whose tools is a candidate is as unknown as a
    // misspelt one.
    for name in &plan.categories {
        let has_candidates = in_categories.iter().any(|&p| {
            index.category_names[index.category[p] as usize].eq_ignore_ascii_case(name.trim())
        });
        if !has_candidates && !unknown_categories.contains(name) {
            unknown_categories.push(name.clone());
        }
    }

    let mut rank = vec![u32::MAX; index.len()];
    for (i, s) in ranked.iter().enumerate() {
        if let Some(slot) = rank.get_mut(s.position) {
            *slot = (*slot).min(u32::try_from(i).unwrap_or(u32::MAX));
        }
    }
    named.sort_by_key(|&p| index.order_key(&rank, p));
    in_categories.sort_by_key(|&p| index.order_key(&rank, p));
    let mut builder = Builder::new(&mask, must_include, policy);
    for position in named.into_iter().chain(in_categories) {
        if builder.full() {
            break;
        }
        builder.add(position);
    }
    let mut selection = builder.finish();
    selection.unknown = unknown;
    selection.unknown_categories = unknown_categories;
    selection
}

// ---------------------------------------------------------------------------
// search_tools

/// The function name of the meta-tool that adds left-out tools.
pub const SEARCH_TOOLS: &str = "search_tools";
/// How many tools one search adds unless its `limit` says otherwise.
pub const DEFAULT_SEARCH_LIMIT: usize = 5;
/// The most tools one search adds.
pub const MAX_SEARCH_LIMIT: usize = 10;
/// Characters of a found tool's description the model reads.
const SEARCH_DESCRIPTION_CHARS: usize = 200;

/// The `search_tools` function as offered to the model (when tools were
/// left out).
#[must_use]
pub fn search_tools_spec() -> ToolSpec {
    ToolSpec {
        name: SEARCH_TOOLS.to_owned(),
        description: "Finds more tools. You were offered only some of the tools available; \
                      when none of yours fits the task, call this with a few words saying \
                      what you need (e.g. \"convert currency\"), and the best matching tools \
                      are added for your next step."
            .to_owned(),
        parameters: json!({
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "minLength": 1,
                    "description": "What the tool should do, in a few words."
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_SEARCH_LIMIT,
                    "description": "How many tools to add at most (default 5)."
                }
            },
            "required": ["query"],
            "additionalProperties": false
        }),
        strict: false,
    }
}

/// What a `search_tools` call did.
#[derive(Debug, Clone)]
pub struct SearchOutcome {
    /// The tools to add to the offer, best first.
    pub added: Vec<Arc<CompiledTool>>,
    /// The tool result the model reads.
    pub text: String,
}

/// Runs a `search_tools` call over `pool` (the permitted tools not
/// offered yet), adding at most `room` tools (what is left under
/// `max_tool_count`) and at most the call's `limit`. Ranks with
/// [`toolfleet_protocol::search`] (the query as one phrase against names,
/// tags and descriptions); when that finds nothing, with the relevance
/// tokens (any word in common) of an index built over `pool` for the
/// call — [`run_search_tools_in`] uses the snapshot's index instead,
/// which is far cheaper on a large pool (BENCHMARKS.md).
///
/// # Errors
///
/// The text for the model when the arguments are unusable (no `query`, a
/// `limit` that is not a number). A `limit` out of `1..=10` is clamped.
pub fn run_search_tools(
    arguments: &Value,
    pool: &[Arc<CompiledTool>],
    room: usize,
) -> Result<SearchOutcome, String> {
    let request = SearchRequest::read(arguments)?;
    let pool: Vec<&Arc<CompiledTool>> = pool.iter().collect();
    Ok(request.run(&pool, room, |query, take| {
        let owned: Vec<Arc<CompiledTool>> = pool.iter().map(|t| Arc::clone(t)).collect();
        let index = RelevanceIndex::build(&owned);
        index
            .score(query, |_| true)
            .iter()
            .take(take)
            .map(|s| Arc::clone(pool[s.position]))
            .collect()
    }))
}

/// [`run_search_tools`] over the tools of `index` at the positions in
/// `pool`, its fallback scoring with `index` itself (no index is built
/// per call).
///
/// # Errors
///
/// As [`run_search_tools`].
pub fn run_search_tools_in(
    arguments: &Value,
    index: &RelevanceIndex,
    pool: &[usize],
    room: usize,
) -> Result<SearchOutcome, String> {
    let request = SearchRequest::read(arguments)?;
    let mask = candidate_mask(index.len(), pool);
    let tools: Vec<&Arc<CompiledTool>> = (0..index.len())
        .filter(|&p| mask[p])
        .filter_map(|p| index.tool(p))
        .collect();
    Ok(request.run(&tools, room, |query, take| {
        index
            .score(query, |p| mask[p])
            .iter()
            .take(take)
            .filter_map(|s| index.tool(s.position).cloned())
            .collect()
    }))
}

/// A `search_tools` call's arguments, checked.
struct SearchRequest<'a> {
    query: &'a str,
    limit: usize,
}

impl<'a> SearchRequest<'a> {
    fn read(arguments: &'a Value) -> Result<Self, String> {
        let query = arguments
            .get("query")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|q| !q.is_empty())
            .ok_or_else(|| {
                format!(
                    "{SEARCH_TOOLS} needs a \"query\": a few words saying what the tool should do"
                )
            })?;
        let limit = match arguments.get("limit") {
            None | Some(Value::Null) => DEFAULT_SEARCH_LIMIT,
            Some(value) => match value.as_f64() {
                Some(n) if n.is_finite() => (n.round().max(1.0) as usize).min(MAX_SEARCH_LIMIT),
                _ => {
                    return Err(format!(
                        "\"limit\" must be a whole number from 1 to {MAX_SEARCH_LIMIT}"
                    ));
                }
            },
        };
        Ok(Self { query, limit })
    }

    /// Phrase search over `pool`, then `by_tokens(query, how many)` when it
    /// finds nothing; the outcome's text for the model.
    fn run(
        &self,
        pool: &[&Arc<CompiledTool>],
        room: usize,
        by_tokens: impl FnOnce(&str, usize) -> Vec<Arc<CompiledTool>>,
    ) -> SearchOutcome {
        let query = self.query;
        if room == 0 {
            return SearchOutcome {
                added: Vec::new(),
                text: "No tool can be added: this conversation already has as many tools as it \
                       may. Carry on with the tools you have."
                    .to_owned(),
            };
        }
        let take = self.limit.min(room);
        let mut hits: Vec<(u32, usize)> = pool
            .iter()
            .enumerate()
            .map(|(i, tool)| (search::score(&tool.definition, query), i))
            .filter(|&(score, _)| score > 0)
            .collect();
        // Stable: equal scores keep the pool's order.
        hits.sort_by_key(|&(score, _)| std::cmp::Reverse(score));
        let mut added: Vec<Arc<CompiledTool>> = hits
            .iter()
            .take(take)
            .map(|&(_, i)| Arc::clone(pool[i]))
            .collect();
        if added.is_empty() {
            added = by_tokens(query, take);
        }
        if added.is_empty() {
            return SearchOutcome {
                added,
                text: format!(
                    "No tool matched {query:?}. Try other words, or carry on with the tools you \
                     have."
                ),
            };
        }
        let mut text = format!(
            "Added {} tool{}; you can call {} from now on:\n",
            added.len(),
            if added.len() == 1 { "" } else { "s" },
            if added.len() == 1 { "it" } else { "them" }
        );
        for tool in &added {
            let f = &tool.definition.function;
            text.push_str(&format!(
                "- {}: {}\n",
                f.name,
                compact(&f.description, SEARCH_DESCRIPTION_CHARS)
            ));
        }
        if room < self.limit && added.len() == room {
            text.push_str("No room for more tools after these.\n");
        }
        SearchOutcome { added, text }
    }
}

// ---------------------------------------------------------------------------
// Suggestions

/// Normalised similarity (Damerau–Levenshtein, `0..=1`) from which a name
/// counts as close.
const MIN_SIMILARITY: f64 = 0.6;
/// Length from which a name contained in another counts as close.
const MIN_CONTAINED_CHARS: usize = 3;

/// Known names close to `name` (a tool the model called that is not
/// offered), best first, at most `max`. Names are compared ignoring case
/// and with `-` as `_`. Close means: equal that way; or a normalised
/// Damerau–Levenshtein similarity of at least 0.6, or an edit distance of
/// at most a third of `name`'s length; or one name containing the other
/// (at least 3 characters; `functions.get_weather` → `get_weather`).
/// Ties are ordered by name.
#[must_use]
pub fn suggest<'a>(
    name: &str,
    known: impl IntoIterator<Item = &'a str>,
    max: usize,
) -> Vec<String> {
    fn normal(s: &str) -> String {
        s.trim().to_lowercase().replace('-', "_")
    }
    let wanted = normal(name);
    if wanted.is_empty() || max == 0 {
        return Vec::new();
    }
    let length = wanted.chars().count();
    let mut seen = HashSet::new();
    let mut close: Vec<(f64, &str)> = known
        .into_iter()
        .filter(|k| seen.insert(*k))
        .filter_map(|k| {
            let candidate = normal(k);
            if candidate.is_empty() {
                return None;
            }
            if candidate == wanted {
                return Some((2.0, k));
            }
            let similarity = strsim::normalized_damerau_levenshtein(&wanted, &candidate);
            let distance = strsim::damerau_levenshtein(&wanted, &candidate);
            let contains = (length >= MIN_CONTAINED_CHARS && candidate.contains(&wanted))
                || (candidate.chars().count() >= MIN_CONTAINED_CHARS
                    && wanted.contains(&candidate));
            (similarity >= MIN_SIMILARITY || distance <= length / 3 || contains)
                .then_some((similarity, k))
        })
        .collect();
    close.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    close
        .into_iter()
        .take(max)
        .map(|(_, k)| k.to_owned())
        .collect()
}

// ---------------------------------------------------------------------------
// Text helpers

/// `text` on one line (whitespace runs as one space), cut to `max`
/// characters with `…` when cut.
fn compact(text: &str, max: usize) -> String {
    let mut out = String::new();
    let mut chars = 0;
    for word in text.split_whitespace() {
        if !out.is_empty() {
            if chars == max {
                out.push('…');
                return out;
            }
            out.push(' ');
            chars += 1;
        }
        for c in word.chars() {
            if chars == max {
                out.push('…');
                return out;
            }
            out.push(c);
            chars += 1;
        }
    }
    out
}

/// The first sentence of `text` (up to the first `. ` or line break), or
/// all of it.
fn first_sentence(text: &str) -> &str {
    let text = text.trim();
    let end = [text.find(". ").map(|i| i + 1), text.find('\n')]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(text.len());
    &text[..end]
}

/// The tokens of one definition, each with the field it was found in,
/// into `out` (new tokens join `vocabulary`).
fn tool_tokens(vocabulary: &mut Vocabulary, out: &mut Vec<(u32, u32)>, d: &ToolDefinition) {
    let mut add = |text: &str, field: usize| {
        for_each_token(text, |token| {
            let number = match vocabulary.get(token) {
                Some(&number) => number,
                None => {
                    let number = u32::try_from(vocabulary.len()).unwrap_or(u32::MAX);
                    vocabulary.insert(token.into(), number);
                    number
                }
            };
            out.push((number, 1 << field));
        });
    };
    add(&d.id.namespace, NAME);
    add(&d.id.name, NAME);
    add(&d.function.name, NAME);
    for tag in &d.tags {
        add(tag, TAG);
    }
    add(&d.category, TAG);
    if let Some(properties) = d
        .function
        .parameters
        .get("properties")
        .and_then(Value::as_object)
    {
        for name in properties.keys() {
            add(name, PARAMETER);
        }
    }
    add(&d.title, DESCRIPTION);
    add(&d.description, DESCRIPTION);
    add(&d.function.description, DESCRIPTION);
}

/// The postings grouped by token, and what scoring needs beside them.
struct Postings {
    offsets: Vec<u32>,
    idf: Vec<f32>,
    postings: Vec<u32>,
    field_totals: Vec<[f32; FIELDS]>,
}

impl Postings {
    /// `pairs` (token, packed posting) of `n` tools over `tokens` tokens as
    /// one array grouped by token (a counting sort keeps each token's
    /// postings in position order), with each token's idf and each tool's
    /// idf total per field.
    fn group(pairs: &[(u32, u32)], tokens: usize, n: usize) -> Self {
        let mut offsets = vec![0u32; tokens + 1];
        for &(token, _) in pairs {
            offsets[token as usize + 1] += 1;
        }
        for t in 0..tokens {
            offsets[t + 1] += offsets[t];
        }
        let idf: Vec<f32> = (0..tokens)
            .map(|t| {
                let df = (offsets[t + 1] - offsets[t]).max(1) as f32;
                (1.0 + n as f32 / df).ln()
            })
            .collect();
        let mut fill = offsets.clone();
        let mut postings = vec![0u32; pairs.len()];
        let mut field_totals = vec![[0f32; FIELDS]; n];
        for &(token, posting) in pairs {
            let slot = &mut fill[token as usize];
            postings[*slot as usize] = posting;
            *slot += 1;
            let totals = &mut field_totals[(posting >> FIELD_BITS) as usize];
            for (field, total) in totals.iter_mut().enumerate() {
                if posting & (1 << field) != 0 {
                    *total += idf[token as usize];
                }
            }
        }
        Self {
            offsets,
            idf,
            postings,
            field_totals,
        }
    }
}

/// Each tool's category number, and the category names by number.
fn categories(tools: &[Arc<CompiledTool>]) -> (Vec<u32>, Vec<String>) {
    let mut numbers: HashMap<&str, u32> = HashMap::new();
    let mut names = Vec::new();
    let category = tools
        .iter()
        .map(|tool| {
            let d = &tool.definition;
            let next = u32::try_from(names.len()).unwrap_or(u32::MAX);
            *numbers.entry(d.category.as_str()).or_insert_with(|| {
                names.push(d.category.clone());
                next
            })
        })
        .collect();
    (category, names)
}

/// Positions in id order, each position's rank in it, and positions in
/// function-name order.
fn orders(tools: &[Arc<CompiledTool>]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let n = tools.len();
    let mut by_id: Vec<u32> = (0..n).filter_map(|p| u32::try_from(p).ok()).collect();
    by_id.sort_by(|&a, &b| {
        tools[a as usize]
            .definition
            .id
            .cmp(&tools[b as usize].definition.id)
    });
    let mut id_rank = vec![0u32; n];
    for (rank, &position) in by_id.iter().enumerate() {
        id_rank[position as usize] = u32::try_from(rank).unwrap_or(u32::MAX);
    }
    let mut by_function = by_id.clone();
    by_function.sort_by(|&a, &b| {
        tools[a as usize]
            .definition
            .function
            .name
            .cmp(&tools[b as usize].definition.function.name)
    });
    (by_id, id_rank, by_function)
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_llm::ToolCall;

    fn tool(
        id: &str,
        function: &str,
        category: &str,
        tags: &[&str],
        parameters: &[&str],
        description: &str,
    ) -> Arc<CompiledTool> {
        tool_with(id, function, category, tags, parameters, description, None)
    }

    fn tool_with(
        id: &str,
        function: &str,
        category: &str,
        tags: &[&str],
        parameters: &[&str],
        description: &str,
        recommended_threshold: Option<f64>,
    ) -> Arc<CompiledTool> {
        let properties: Map<String, Value> = parameters
            .iter()
            .map(|p| ((*p).to_owned(), json!({"type": "string"})))
            .collect();
        let mut definition = json!({
            "schemaVersion": 1,
            "id": id,
            "implementationKey": "test.tool",
            "title": "A tool",
            "description": description,
            "category": category,
            "tags": tags,
            "function": {
                "name": function,
                "description": description,
                "parameters": { "type": "object", "properties": properties }
            }
        });
        if let Some(t) = recommended_threshold {
            definition["recommendedThreshold"] = json!(t);
        }
        let definition = serde_json::from_value(definition).expect("a valid definition");
        Arc::new(CompiledTool::new(definition).expect("compiles"))
    }

    /// `n` filler tools that share no word with the queries below.
    fn fillers(n: usize) -> Vec<Arc<CompiledTool>> {
        (0..n)
            .map(|i| {
                tool(
                    &format!("misc:filler_{i}@1.0.0"),
                    &format!("filler_{i}"),
                    "misc",
                    &["misc"],
                    &["x"],
                    "Does nothing useful.",
                )
            })
            .collect()
    }

    fn policy() -> ScopingPolicy {
        ScopingPolicy::default()
    }

    fn names(index: &RelevanceIndex, positions: &[usize]) -> Vec<String> {
        positions
            .iter()
            .map(|&p| index.tools()[p].definition.function.name.clone())
            .collect()
    }

    fn owned(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    fn user(text: &str) -> Message {
        Message::User {
            content: text.to_owned(),
        }
    }

    fn assistant(text: Option<&str>, calls: &[&str]) -> Message {
        Message::Assistant {
            content: text.map(str::to_owned),
            tool_calls: calls
                .iter()
                .enumerate()
                .map(|(i, name)| ToolCall {
                    id: format!("call_{i}"),
                    name: (*name).to_owned(),
                    arguments: "{}".to_owned(),
                })
                .collect(),
            opaque: Vec::new(),
        }
    }

    #[test]
    fn tokens_split_case_and_separators_and_drop_stop_words() {
        assert_eq!(tokens("getHTTPStatus"), owned(&["get", "http", "status"]));
        assert_eq!(tokens("search_documents"), owned(&["search", "document"]));
        assert_eq!(
            tokens("utf8Encode x-ray"),
            owned(&["utf8", "encode", "ray"])
        );
        assert_eq!(
            tokens("What is the weather in Paris, please?"),
            owned(&["weather", "paris"])
        );
        // One-character tokens go; repeats stay (the index dedupes).
        assert_eq!(tokens("a b cd cd"), owned(&["cd", "cd"]));
        assert_eq!(
            tokens("queries addresses files status boxes matches bus"),
            owned(&["query", "address", "file", "status", "box", "match", "bus"])
        );
        assert_eq!(tokens("ÉtéCafé"), owned(&["été", "café"]));
        assert!(tokens("  --  ").is_empty());
        assert_eq!(
            tokens("I'll check, don't worry"),
            owned(&["check", "worry"])
        );
        assert!(
            STOP_WORDS.windows(2).all(|w| w[0] < w[1]),
            "STOP_WORDS must stay sorted for binary_search"
        );
    }

    #[test]
    fn a_name_match_beats_a_description_match() {
        let tools = vec![
            tool(
                "misc:almanac@1.0.0",
                "almanac",
                "reference",
                &["facts"],
                &["topic"],
                "Facts about history, sports, weather records and more.",
            ),
            tool(
                "web:get_weather@1.0.0",
                "get_weather",
                "web",
                &["forecast"],
                &["city"],
                "Tells the forecast for a city.",
            ),
            tool(
                "web:stock_price@1.0.0",
                "stock_price",
                "finance",
                &["market"],
                &["symbol"],
                "Gives a share's last price.",
            ),
        ];
        let index = RelevanceIndex::build(&tools);
        let ranked = index.score("What's the weather like in Paris?", |_| true);
        let order: Vec<usize> = ranked.iter().map(|s| s.position).collect();
        assert_eq!(order, [1, 0], "{ranked:?}");
        assert!(
            ranked
                .iter()
                .all(|s| s.relevance > 0.0 && s.relevance <= 1.0)
        );
        assert!(
            ranked[0].relevance > 2.0 * ranked[1].relevance,
            "{ranked:?}"
        );
        // A tool the predicate refuses is not scored.
        let only_almanac = index.score("weather", |p| p == 0);
        assert_eq!(only_almanac.len(), 1);
        assert_eq!(only_almanac[0].position, 0);
        // Nothing in common, or nothing but stop words: nothing scores.
        assert!(index.score("zebra crossing", |_| true).is_empty());
        assert!(index.score("the of and", |_| true).is_empty());
        // Every token of every field mentioned: relevance 1.
        let full = index.score(
            "web get weather forecast city tells the forecast for a city a tool",
            |p| p == 1,
        );
        assert!((full[0].relevance - 1.0).abs() < 1e-6, "{full:?}");
    }

    #[test]
    fn equal_relevance_is_ordered_by_tool_id() {
        // The same tokens (geo, find, city) in every field: equal
        // relevance. Versions compare as numbers (10 after 2).
        let city = |id: &str, function: &str| tool(id, function, "geo", &[], &[], "Finds a city.");
        let tools = vec![
            city("geo:find_city@10.0.0", "FindCity"),
            city("geo:find_city@2.0.0", "find_city"),
            city("geo:city_find@1.0.0", "city_find"),
            city("geo:find_city@1.0.0", "findCity"),
        ];
        let index = RelevanceIndex::build(&tools);
        let ranked = index.score("find a city", |_| true);
        assert_eq!(ranked.len(), 4);
        assert!(ranked.iter().all(|s| s.relevance == ranked[0].relevance));
        let order: Vec<usize> = ranked.iter().map(|s| s.position).collect();
        assert_eq!(order, [2, 3, 1, 0]);
        // Built from the slice in another order, the same tools rank the
        // same way.
        let reversed: Vec<Arc<CompiledTool>> = tools.iter().rev().cloned().collect();
        let index = RelevanceIndex::build(&reversed);
        let ids: Vec<String> = index
            .score("find a city", |_| true)
            .iter()
            .map(|s| reversed[s.position].definition.id.to_string())
            .collect();
        assert_eq!(
            ids,
            [
                "geo:city_find@1.0.0",
                "geo:find_city@1.0.0",
                "geo:find_city@2.0.0",
                "geo:find_city@10.0.0"
            ]
        );
    }

    #[test]
    fn stages_follow_the_thresholds() {
        let p = policy();
        assert_eq!(stage(0, false, &p), Stage::All);
        assert_eq!(stage(30, false, &p), Stage::All);
        assert_eq!(stage(31, false, &p), Stage::Relevance);
        assert_eq!(stage(100, false, &p), Stage::Relevance);
        assert_eq!(stage(101, false, &p), Stage::Planning);
        // Imported MCP tools: planning as soon as tools are left out.
        assert_eq!(stage(30, true, &p), Stage::All);
        assert_eq!(stage(31, true, &p), Stage::Planning);
    }

    #[test]
    fn the_query_is_the_latest_user_message_and_the_last_assistant_message() {
        let messages = vec![
            Message::System {
                content: "You are helpful.".to_owned(),
            },
            user("first question"),
            assistant(Some("first answer"), &[]),
            user("convert 3 miles to km"),
            assistant(None, &["convert_units"]),
            Message::Tool {
                call_id: "call_0".to_owned(),
                content: "4.83 km".to_owned(),
            },
        ];
        assert_eq!(
            scoring_query(&messages),
            "convert 3 miles to km\nconvert_units"
        );
        assert_eq!(scoring_query(&[]), "");
    }

    #[test]
    fn must_include_tools_are_always_in_and_the_caps_hold() {
        let mut tools: Vec<Arc<CompiledTool>> = (0..50)
            .map(|i| {
                tool(
                    &format!("weather:station_{i:02}@1.0.0"),
                    &format!("weather_station_{i:02}"),
                    "weather",
                    &[],
                    &[],
                    "Reads a weather station.",
                )
            })
            .collect();
        tools.extend(fillers(10));
        let index = RelevanceIndex::build(&tools);
        let must = [50, 51, 52, 50, 9999];
        let p = policy();

        let all: Vec<usize> = (0..index.len()).collect();
        let selection = by_relevance(&index, &all, "weather", &p, &must);
        assert_eq!(selection.chosen.len(), 23, "3 must-include + 20");
        assert_eq!(&selection.chosen[..3], &[50, 51, 52]);
        assert_eq!(selection.left_out, 60 - 23);
        let unique: HashSet<usize> = selection.chosen.iter().copied().collect();
        assert_eq!(unique.len(), selection.chosen.len());

        let tight = ScopingPolicy {
            max_tool_count: 21,
            ..p
        };
        let selection = by_relevance(&index, &all, "weather", &tight, &must);
        assert_eq!(selection.chosen.len(), 21);
        assert_eq!(&selection.chosen[..3], &[50, 51, 52]);

        // More must-include tools than the cap: all in, nothing else.
        let tiny = ScopingPolicy {
            max_tool_count: 2,
            initial_tool_count: 2,
            ..p
        };
        let selection = by_relevance(&index, &all, "weather", &tiny, &must);
        assert_eq!(selection.chosen, [50, 51, 52]);

        // Only candidates are picked by relevance.
        let even: Vec<usize> = (0..index.len()).filter(|p| p % 2 == 0).collect();
        let selection = by_relevance(&index, &even, "weather", &p, &[]);
        assert_eq!(selection.chosen.len(), 20);
        assert!(selection.chosen.iter().all(|p| p % 2 == 0));
        assert_eq!(selection.left_out, 30 - 20);
    }

    #[test]
    fn only_tools_that_score_are_picked_unless_none_does() {
        let mut tools = fillers(40);
        tools.push(tool(
            "geo:distance@1.0.0",
            "distance",
            "geo",
            &[],
            &["from", "to"],
            "Distance between two places.",
        ));
        let index = RelevanceIndex::build(&tools);
        let p = policy();
        let all: Vec<usize> = (0..index.len()).collect();
        let selection = by_relevance(&index, &all, "what distance is it", &p, &[3]);
        assert_eq!(selection.chosen, [3, 40]);
        assert_eq!(selection.left_out, 39);

        // No candidate shares a word: the first 20 by tool id.
        let selection = by_relevance(&index, &all, "zebra", &p, &[]);
        assert_eq!(selection.chosen.len(), 20);
        let mut expected: Vec<usize> = (0..41).collect();
        expected.sort_by(|&a, &b| tools[a].definition.id.cmp(&tools[b].definition.id));
        assert_eq!(selection.chosen, expected[..20]);
    }

    #[test]
    fn a_recommended_threshold_extends_the_selection_up_to_the_cap() {
        // 30 equally relevant tools: the top 20 by id, then those whose
        // threshold the relevance reaches.
        let tools: Vec<Arc<CompiledTool>> = (0..30)
            .map(|i| {
                let threshold = match i % 3 {
                    0 => Some(0.0),
                    1 => Some(1.0),
                    _ => None,
                };
                tool_with(
                    &format!("mail:send_{i:02}@1.0.0"),
                    &format!("send_mail_{i:02}"),
                    "mail",
                    &[],
                    &[],
                    "Sends mail.",
                    threshold,
                )
            })
            .collect();
        let index = RelevanceIndex::build(&tools);
        let p = policy();
        let all: Vec<usize> = (0..index.len()).collect();
        let selection = by_relevance(&index, &all, "send mail", &p, &[]);
        let mut expected: Vec<usize> = (0..20).collect();
        expected.extend([21, 24, 27]);
        assert_eq!(selection.chosen, expected);
        assert_eq!(selection.left_out, 7);

        let capped = ScopingPolicy {
            max_tool_count: 22,
            ..p
        };
        let selection = by_relevance(&index, &all, "send mail", &capped, &[]);
        assert_eq!(selection.chosen.len(), 22);
        assert_eq!(&selection.chosen[20..], &[21, 24]);
    }

    #[test]
    fn plans_are_read_from_plain_fenced_and_wordy_answers() {
        let expected = Plan {
            tools: owned(&["get_weather", "send_mail"]),
            categories: owned(&["finance"]),
        };
        let plain = r#"{"tools": ["get_weather", "send_mail"], "categories": ["finance"]}"#;
        assert_eq!(parse_plan(plain), Ok(expected.clone()));
        let fenced = format!("```json\n{plain}\n```");
        assert_eq!(parse_plan(&fenced), Ok(expected.clone()));
        let wordy = format!("Sure {{ok}}! Here is the plan:\n{plain}\nHope it helps {{:)}}.");
        assert_eq!(parse_plan(&wordy), Ok(expected));

        // Repeats and blanks go, a lone string is a list, non-strings skip.
        let loose = r#"{"tools": "get_weather", "categories": ["a", " a ", "", 3, null]}"#;
        assert_eq!(
            parse_plan(loose),
            Ok(Plan {
                tools: owned(&["get_weather"]),
                categories: owned(&["a"]),
            })
        );
        let only_tools = r#"{"tools": ["x"]}"#;
        assert_eq!(parse_plan(only_tools).map(|p| p.categories.len()), Ok(0));
    }

    #[test]
    fn unusable_plans_are_clear_errors() {
        let garbage = parse_plan("I think you should use the weather tool.");
        assert!(
            matches!(garbage, Err(PlanError::NoJson { .. })),
            "{garbage:?}"
        );
        let message = garbage.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("no JSON object"), "{message}");
        assert!(message.contains("use the weather tool"), "{message}");

        for empty in [
            "{}",
            r#"{"tools": [], "categories": []}"#,
            r#"{"tools": [""], "other": 1}"#,
            r#"```json {"plan": "none"} ```"#,
        ] {
            assert!(
                matches!(parse_plan(empty), Err(PlanError::Empty { .. })),
                "{empty}"
            );
        }
        // A long answer is quoted short.
        let long = "x".repeat(5000);
        let message = parse_plan(&long)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.len() < 300, "{}", message.len());
        assert!(message.contains('…'));
        assert!(matches!(parse_plan(""), Err(PlanError::NoJson { .. })));
        assert!(matches!(
            parse_plan("{\"tools\": [\"a\""),
            Err(PlanError::NoJson { .. })
        ));
    }

    #[test]
    fn planning_messages_are_compact_and_marked() {
        let p = ScopingPolicy {
            planning_history_message_count: 3,
            ..policy()
        };
        let history = vec![
            Message::System {
                content: "SYSTEM PROMPT".to_owned(),
            },
            user("old question that falls out"),
            user("Book a flight to Lisbon"),
            assistant(Some("Looking."), &["search_flights"]),
            Message::Tool {
                call_id: "call_0".to_owned(),
                content: format!("{}END", "result ".repeat(100)),
            },
        ];
        let tools: Vec<Arc<CompiledTool>> = (0..150)
            .map(|i| {
                tool(
                    &format!("travel:tool_{i}@1.0.0"),
                    &format!("tool_{i}"),
                    "travel",
                    &[],
                    &[],
                    "Books things. Second sentence is left out.",
                )
            })
            .collect();
        let candidates: Vec<&CompiledTool> = tools.iter().map(|t| &**t).collect();
        let categories = vec![("travel".to_owned(), 150), ("finance".to_owned(), 3)];
        // A profile's own instructions replace the built-in ones; the
        // conversation and candidates follow them the same.
        let own = planning_messages(
            &history,
            &candidates,
            &categories,
            &p,
            Some("House rules: at most {max_tools} tools, JSON only."),
        );
        assert!(
            matches!(&own[0], Message::System { content } if content == "House rules: at most 30 tools, JSON only."),
            "{own:?}"
        );
        let messages = planning_messages(&history, &candidates, &categories, &p, None);
        assert_eq!(own[1..], messages[1..]);
        assert_eq!(messages.len(), 2);
        let Message::System { content: system } = &messages[0] else {
            panic!("{messages:?}");
        };
        assert!(system.contains(r#"{"tools": ["#), "{system}");
        assert!(system.contains("at most 30 tools"), "{system}");
        let Message::User { content } = &messages[1] else {
            panic!("{messages:?}");
        };
        assert_eq!(content.lines().next(), Some(PLANNING_MARKER));
        assert!(content.contains("user: Book a flight to Lisbon"));
        assert!(content.contains("assistant: Looking. [called: search_flights]"));
        assert!(content.contains("tool: result result"));
        assert!(!content.contains("END"), "tool results are abbreviated");
        assert!(!content.contains("old question") && !content.contains("SYSTEM PROMPT"));
        assert!(content.contains("- tool_99: Books things.\n"));
        assert!(!content.contains("tool_100:"), "at most 100 candidates");
        assert!(!content.contains("Second sentence"));
        assert!(content.contains("- travel (150)\n- finance (3)\n"));
        assert!(content.len() < 4000, "{}", content.len());
    }

    #[test]
    fn a_plan_picks_named_tools_then_its_categories_and_reports_unknown_names() {
        let mut tools = vec![
            tool(
                "mail:send@1.0.0",
                "send_mail",
                "mail",
                &[],
                &[],
                "Sends mail.",
            ),
            tool(
                "mail:read@1.0.0",
                "read_mail",
                "mail",
                &[],
                &[],
                "Reads mail.",
            ),
            tool(
                "mail:search@1.0.0",
                "search_mail",
                "mail",
                &[],
                &[],
                "Searches mail by words.",
            ),
            tool(
                "cal:add@1.0.0",
                "add_event",
                "calendar",
                &[],
                &[],
                "Adds an event.",
            ),
            tool(
                "cal:list@2.0.0",
                "list_events",
                "calendar",
                &[],
                &[],
                "Lists events.",
            ),
            tool(
                "secret:vault@1.0.0",
                "open_vault",
                "security",
                &[],
                &[],
                "Opens the vault.",
            ),
        ];
        tools.extend(fillers(5));
        let index = RelevanceIndex::build(&tools);
        let candidates: Vec<usize> = (0..index.len()).filter(|&p| p != 5).collect();
        let mask = candidate_mask(index.len(), &candidates);
        let ranked = index.score("search my mail for the invitation", |p| mask[p]);
        let plan = Plan {
            tools: owned(&["cal:list", "add_event", "open_vault", "no_such_tool"]),
            categories: owned(&["MAIL", "gardening", "security"]),
        };
        let p = policy();
        let selection = apply_plan(&plan, &index, &candidates, &ranked, &p, &[7]);
        // The must-include, the named tools (unscored: by id), then the
        // category by relevance: search_mail, then the other two by id.
        assert_eq!(
            names(&index, &selection.chosen),
            owned(&[
                "filler_1",
                "add_event",
                "list_events",
                "search_mail",
                "read_mail",
                "send_mail"
            ])
        );
        assert_eq!(selection.unknown, owned(&["open_vault", "no_such_tool"]));
        assert_eq!(
            selection.unknown_categories,
            owned(&["gardening", "security"])
        );
        assert_eq!(selection.left_out, 4);

        // The cap holds, and named tools go first.
        let tight = ScopingPolicy {
            max_tool_count: 3,
            initial_tool_count: 3,
            ..p
        };
        let selection = apply_plan(&plan, &index, &candidates, &ranked, &tight, &[7]);
        assert_eq!(
            names(&index, &selection.chosen),
            owned(&["filler_1", "add_event", "list_events"])
        );

        // A plan naming nothing usable leaves the must-include tools only
        // (the caller falls back to the relevance selection).
        let useless = Plan {
            tools: owned(&["open_vault"]),
            categories: owned(&["security"]),
        };
        let selection = apply_plan(&useless, &index, &candidates, &ranked, &p, &[7]);
        assert_eq!(selection.chosen, [7]);
        assert_eq!(selection.unknown, owned(&["open_vault"]));
        assert_eq!(selection.unknown_categories, owned(&["security"]));
        let fallback = select_ranked(&index, &candidates, &ranked, &p, &[7]);
        assert_eq!(
            names(&index, &fallback.chosen[..2]),
            owned(&["filler_1", "search_mail"])
        );
    }

    #[test]
    fn tools_are_found_by_function_name_id_and_name() {
        let tools = vec![
            tool(
                "units:convert@1.2.0",
                "convert_units",
                "units",
                &[],
                &[],
                "Converts.",
            ),
            tool(
                "units:convert@1.10.0",
                "convert_units_new",
                "units",
                &[],
                &[],
                "Converts.",
            ),
            tool("web:fetch@1.0.0", "fetch_page", "web", &[], &[], "Fetches."),
        ];
        let index = RelevanceIndex::build(&tools);
        assert_eq!(index.position("fetch_page"), Some(2));
        assert_eq!(index.position(" Fetch_Page "), Some(2));
        assert_eq!(index.position("units:convert@1.2.0"), Some(0));
        assert_eq!(index.position("units:convert@9.0.0"), None);
        assert_eq!(index.position("units:convert"), Some(1), "highest version");
        assert_eq!(index.position("units:nothing"), None);
        assert_eq!(index.position("nothing"), None);
        assert_eq!(
            index.categories(|_| true),
            vec![("units".to_owned(), 2), ("web".to_owned(), 1)]
        );
        assert_eq!(index.categories(|p| p == 2), vec![("web".to_owned(), 1)]);
    }

    #[test]
    fn search_tools_adds_what_it_finds_within_the_room() {
        let pool = vec![
            tool(
                "fx:convert_currency@1.0.0",
                "convert_currency",
                "finance",
                &["money"],
                &["amount"],
                "Converts an amount between currencies.",
            ),
            tool(
                "fx:currency_rates@1.0.0",
                "currency_rates",
                "finance",
                &["money"],
                &[],
                "Today's currency rates.",
            ),
            tool(
                "fx:currency_history@1.0.0",
                "currency_history",
                "finance",
                &["money"],
                &[],
                "Past currency rates.",
            ),
            tool(
                "geo:distance@1.0.0",
                "distance",
                "geo",
                &[],
                &[],
                "Distance between two places.",
            ),
        ];
        let spec = search_tools_spec();
        assert_eq!(spec.name, SEARCH_TOOLS);
        assert_eq!(spec.parameters["required"], json!(["query"]));
        assert_eq!(spec.parameters["properties"]["limit"]["maximum"], json!(10));

        let outcome = run_search_tools(&json!({"query": "currency"}), &pool, 2).expect("runs");
        let added: Vec<&str> = outcome
            .added
            .iter()
            .map(|t| t.definition.function.name.as_str())
            .collect();
        assert_eq!(
            added,
            ["currency_rates", "currency_history"],
            "name prefix first"
        );
        assert!(outcome.text.contains("Added 2 tools"), "{}", outcome.text);
        assert!(
            outcome
                .text
                .contains("- currency_rates: Today's currency rates.")
        );
        assert!(
            outcome.text.contains("No room for more"),
            "{}",
            outcome.text
        );

        let outcome =
            run_search_tools(&json!({"query": "currency", "limit": 1}), &pool, 5).expect("runs");
        assert_eq!(outcome.added.len(), 1);
        assert!(!outcome.text.contains("No room"));

        // No phrase match: the relevance tokens find it.
        let outcome =
            run_search_tools(&json!({"query": "how far to other places"}), &pool, 5).expect("runs");
        assert_eq!(outcome.added.len(), 1);
        assert_eq!(outcome.added[0].definition.function.name, "distance");

        let outcome = run_search_tools(&json!({"query": "zebra"}), &pool, 5).expect("runs");
        assert!(outcome.added.is_empty());
        assert!(
            outcome.text.contains("No tool matched \"zebra\""),
            "{}",
            outcome.text
        );

        let outcome = run_search_tools(&json!({"query": "currency"}), &pool, 0).expect("runs");
        assert!(outcome.added.is_empty());
        assert!(
            outcome.text.contains("No tool can be added"),
            "{}",
            outcome.text
        );

        let outcome =
            run_search_tools(&json!({"query": "currency", "limit": 99}), &pool, 99).expect("runs");
        assert_eq!(outcome.added.len(), 3, "clamped to 10, three match");

        // The indexed variant finds the same over the same pool.
        let mut catalog = fillers(3);
        catalog.extend(pool.iter().cloned());
        let index = RelevanceIndex::build(&catalog);
        let positions: Vec<usize> = (3..catalog.len()).collect();
        for (query, room) in [
            ("currency", 2),
            ("how far to other places", 5),
            ("zebra", 5),
        ] {
            let arguments = json!({ "query": query });
            let direct = run_search_tools(&arguments, &pool, room).expect("runs");
            let indexed = run_search_tools_in(&arguments, &index, &positions, room).expect("runs");
            assert_eq!(indexed.text, direct.text, "{query}");
        }
        // Tools outside the pool are never added.
        let outcome =
            run_search_tools_in(&json!({"query": "filler"}), &index, &positions, 5).expect("runs");
        assert!(outcome.added.is_empty(), "{}", outcome.text);

        for bad in [
            json!({}),
            json!({"query": "  "}),
            json!({"query": 3}),
            json!({"query": "x", "limit": "two"}),
            json!("currency"),
        ] {
            assert!(run_search_tools(&bad, &pool, 5).is_err(), "{bad}");
        }
    }

    #[test]
    fn close_names_are_suggested_best_first() {
        let known = [
            "get_weather",
            "get_whether_ok",
            "set_weather",
            "send_mail",
            "weather_alerts",
            "ls",
        ];
        let got = suggest("get_wether", known, 3);
        assert_eq!(got[0], "get_weather");
        assert!(got.len() <= 3);
        assert!(!got.contains(&"send_mail".to_owned()));
        assert_eq!(suggest("Get-Weather", known, 1), ["get_weather"]);
        assert_eq!(suggest("functions.get_weather", known, 1), ["get_weather"]);
        let contained = suggest("weather", known, 10);
        assert!(
            contained.contains(&"weather_alerts".to_owned()),
            "{contained:?}"
        );
        assert!(
            contained.contains(&"get_weather".to_owned()),
            "{contained:?}"
        );
        assert!(suggest("cd", known, 5).is_empty());
        assert!(suggest("translate_text", known, 5).is_empty());
        assert!(suggest("", known, 5).is_empty());
        assert!(suggest("get_weather", known, 0).is_empty());
    }
}
