//! Citations and the result ledger in Redis, and reader-side rendering.
//!
//! This is the only module that speaks Redis. Per invocation, with one hash
//! tag so a cluster keeps the keys in one slot:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<inv>}:seq` | string (INCR) | the shared reference counter: `[doc:N]` never collide |
//! | `<p>:{<inv>}:refs` | hash | `[doc:N]` → reference JSON |
//! | `<p>:{<inv>}:call:<call>` | string | the indices a call reserved, so a redelivered job reuses them |
//! | `<p>:{<inv>}:result:<call>` | string | the result ledger: a redelivered job returns the stored result |
//!
//! Every key carries the TTL. References are written by one Lua script, so
//! a reservation is atomic: the counter, the hash and the call's indices move
//! together or not at all.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::ConnectionManager;

use crate::protocol::{Reference, ToolResult};

/// Default lifetime of an invocation's keys.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Clone, thiserror::Error)]
#[error("citation store: {0}")]
pub struct CitationError(String);

impl From<redis::RedisError> for CitationError {
    fn from(e: redis::RedisError) -> Self {
        // RedisError's Display can include the server's message but never
        // the URL or password.
        CitationError(e.to_string())
    }
}

const RESERVE: &str = r#"
local n = #ARGV - 1
local ttl = tonumber(ARGV[1])
local existing = redis.call('GET', KEYS[3])
if existing then
  local count = 0
  if existing ~= '' then
    for _ in string.gmatch(existing, '[^,]+') do count = count + 1 end
  end
  if count == n then
    local i = 1
    for idx in string.gmatch(existing, '[^,]+') do
      redis.call('HSET', KEYS[2], '[doc:' .. idx .. ']', ARGV[i + 1])
      i = i + 1
    end
    return existing
  end
end
local out = {}
if n > 0 then
  local last = redis.call('INCRBY', KEYS[1], n)
  local first = last - n + 1
  for i = 1, n do
    local idx = first + i - 1
    redis.call('HSET', KEYS[2], '[doc:' .. idx .. ']', ARGV[i + 1])
    out[i] = tostring(idx)
  end
end
local s = table.concat(out, ',')
redis.call('SET', KEYS[3], s, 'EX', ttl)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return s
"#;

/// A handle on the citation store; cheap to clone.
#[derive(Clone)]
pub struct CitationStore {
    conn: ConnectionManager,
    prefix: String,
    ttl: Duration,
    reserve: redis::Script,
}

impl std::fmt::Debug for CitationStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CitationStore")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// A reference before it has an index.
#[derive(Debug, Clone, PartialEq)]
pub struct NewReference {
    pub kind: String,
    pub title: String,
    pub source: Option<String>,
    pub url: Option<String>,
    pub snippet: Option<String>,
}

impl CitationStore {
    /// Connects, with automatic reconnection afterwards.
    pub async fn connect(url: &str, prefix: &str, ttl: Duration) -> Result<Self, CitationError> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(2);
        let conn = client.get_connection_manager_with_config(config).await?;
        Ok(Self {
            conn,
            prefix: prefix.to_string(),
            ttl,
            reserve: redis::Script::new(RESERVE),
        })
    }

    /// The key layout, in one place.
    pub fn key(&self, invocation_id: &str, part: &str) -> String {
        format!("{}:{{{invocation_id}}}:{part}", self.prefix)
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Atomically takes indices from the invocation's counter and stores the
    /// references under them. A second call for the same `call_id` with the
    /// same number of references reuses the first call's indices.
    ///
    /// `reservation` names this reservation (the call id, or the call id
    /// and a counter when one call cites more than once); `call_id` goes
    /// into the references.
    pub async fn reserve(
        &self,
        invocation_id: &str,
        reservation: &str,
        call_id: &str,
        tool_id: &str,
        refs: Vec<NewReference>,
    ) -> Result<Vec<Reference>, CitationError> {
        let mut inv = self.reserve.prepare_invoke();
        inv.key(self.key(invocation_id, "seq"))
            .key(self.key(invocation_id, "refs"))
            .key(self.key(invocation_id, &format!("call:{reservation}")))
            .arg(self.ttl.as_secs().max(1));
        let mut stored = Vec::with_capacity(refs.len());
        for r in refs {
            let reference = Reference {
                index: 0,
                kind: r.kind,
                title: r.title,
                source: r.source,
                url: r.url,
                snippet: r.snippet,
                tool_id: Some(tool_id.to_string()),
                call_id: Some(call_id.to_string()),
            };
            inv.arg(crate::protocol::encode(&reference).to_vec());
            stored.push(reference);
        }
        let mut conn = self.conn.clone();
        let indices: String = inv.invoke_async(&mut conn).await?;
        let indices = indices
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u64>()
                    .map_err(|_| CitationError(format!("bad index {s:?} from the store")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if indices.len() != stored.len() {
            return Err(CitationError(format!(
                "store returned {} indices for {} references",
                indices.len(),
                stored.len()
            )));
        }
        for (r, i) in stored.iter_mut().zip(indices) {
            r.index = i;
        }
        Ok(stored)
    }

    /// Every reference of the invocation, sorted by index.
    pub async fn references(&self, invocation_id: &str) -> Result<Vec<Reference>, CitationError> {
        let mut conn = self.conn.clone();
        let all: HashMap<String, String> = conn.hgetall(self.key(invocation_id, "refs")).await?;
        let mut out = Vec::with_capacity(all.len());
        for (field, json) in all {
            let Some(index) = field
                .strip_prefix("[doc:")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            // A foreign value in the hash is skipped, not fatal: the reader
            // still gets every reference it can use.
            if let Ok(mut r) = serde_json::from_str::<Reference>(&json) {
                r.index = index;
                out.push(r);
            }
        }
        out.sort_by_key(|r| r.index);
        Ok(out)
    }

    /// The stored result of an earlier attempt of this call, if any.
    pub async fn ledger_get(
        &self,
        invocation_id: &str,
        call_id: &str,
    ) -> Result<Option<ToolResult>, CitationError> {
        let mut conn = self.conn.clone();
        let v: Option<String> = conn
            .get(self.key(invocation_id, &format!("result:{call_id}")))
            .await?;
        Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
    }

    pub async fn ledger_put(&self, result: &ToolResult) -> Result<(), CitationError> {
        let mut conn = self.conn.clone();
        let key = self.key(&result.invocation_id, &format!("result:{}", result.call_id));
        let json = serde_json::to_string(result).map_err(|e| CitationError(e.to_string()))?;
        let _: () = conn.set_ex(key, json, self.ttl.as_secs().max(1)).await?;
        Ok(())
    }

    /// Is the store answering?
    pub async fn ping(&self) -> Result<(), CitationError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}

/// Every `N` of a `[doc:N]` marker in `text`, in order of appearance.
pub fn cited_indices(text: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("[doc:") {
        let after = &rest[start + 5..];
        let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() && after[digits.len()..].starts_with(']') {
            if let Ok(n) = digits.parse() {
                out.push(n);
            }
            rest = &after[digits.len() + 1..];
        } else {
            rest = after;
        }
    }
    out
}

/// An answer ready for a reader.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The text with `[doc:N]` replaced by display markers `[1]`, `[2]`, ….
    pub text: String,
    /// The cited references, in display order, with `index` set to the
    /// display index.
    pub references: Vec<Reference>,
}

impl Rendered {
    /// The text followed by a numbered reference list.
    pub fn to_markdown(&self) -> String {
        let mut out = self.text.trim_end().to_string();
        if !self.references.is_empty() {
            out.push_str("\n\nReferences:\n");
            for r in &self.references {
                out.push_str(&format!("[{}] {}", r.index, r.title));
                if let Some(s) = &r.source {
                    out.push_str(&format!(" — {s}"));
                }
                if let Some(u) = &r.url {
                    out.push_str(&format!(" <{u}>"));
                }
                out.push('\n');
            }
        }
        out
    }
}

/// Keeps only references cited in `text`, sorts them by index, and remaps
/// them to display indices 1..k. The replacement runs in two phases
/// (markers to placeholders, placeholders to display markers) so `[doc:2]`
/// becoming `[1]` can never be rewritten again by the rule for `[doc:1]`.
/// Markers without a reference are dropped from the text: a reader must
/// never see a number that resolves to nothing.
pub fn render(text: &str, references: &[Reference]) -> Rendered {
    let known: BTreeMap<u64, &Reference> = references.iter().map(|r| (r.index, r)).collect();
    let mut cited: Vec<u64> = cited_indices(text)
        .into_iter()
        .filter(|n| known.contains_key(n))
        .collect();
    cited.sort_unstable();
    cited.dedup();
    let display: BTreeMap<u64, usize> =
        cited.iter().enumerate().map(|(i, n)| (*n, i + 1)).collect();

    // Phase 1: every marker becomes a placeholder (or nothing).
    let mut phase1 = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[doc:") {
        phase1.push_str(&rest[..start]);
        let after = &rest[start + 5..];
        let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() && after[digits.len()..].starts_with(']') {
            let n: u64 = digits.parse().unwrap_or(0);
            if let Some(d) = display.get(&n) {
                phase1.push_str(&format!("\u{0}{d}\u{0}"));
            } else if phase1.ends_with(' ') {
                // Drop the dangling marker and the space before it.
                phase1.pop();
            }
            rest = &after[digits.len() + 1..];
        } else {
            phase1.push_str("[doc:");
            rest = after;
        }
    }
    phase1.push_str(rest);

    // Phase 2: placeholders become display markers.
    let mut out = String::with_capacity(phase1.len());
    let mut parts = phase1.split('\u{0}');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    let mut is_marker = true;
    for p in parts {
        if is_marker {
            out.push_str(&format!("[{p}]"));
        } else {
            out.push_str(p);
        }
        is_marker = !is_marker;
    }

    let references = cited
        .iter()
        .map(|n| {
            let mut r = known[n].clone();
            r.index = display[n] as u64;
            r
        })
        .collect();
    Rendered {
        text: out,
        references,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(index: u64, title: &str) -> Reference {
        Reference {
            index,
            kind: "document".into(),
            title: title.into(),
            source: Some(format!("{title}.md")),
            url: None,
            snippet: None,
            tool_id: None,
            call_id: None,
        }
    }

    #[test]
    fn finds_markers() {
        assert_eq!(
            cited_indices("a [doc:3] b [doc:12][doc:x] [doc:] [doc:7]"),
            vec![3, 12, 7]
        );
    }

    #[test]
    fn renders_only_cited_references_remapped_in_two_phases() {
        let refs = vec![r(1, "one"), r(2, "two"), r(3, "three"), r(5, "five")];
        let out = render(
            "B [doc:5], A [doc:2] and B again [doc:5]. Ghost [doc:9].",
            &refs,
        );
        // [doc:2] → [1], [doc:5] → [2]; the uncited [doc:1] and [doc:3]
        // are dropped from the list and the unknown [doc:9] from the text.
        assert_eq!(out.text, "B [2], A [1] and B again [2]. Ghost.");
        let titles: Vec<_> = out
            .references
            .iter()
            .map(|r| (r.index, r.title.as_str()))
            .collect();
        assert_eq!(titles, vec![(1, "two"), (2, "five")]);
        let md = out.to_markdown();
        assert!(
            md.ends_with("References:\n[1] two — two.md\n[2] five — five.md\n"),
            "{md}"
        );
    }

    #[test]
    fn remapping_does_not_chain() {
        // [doc:2] becomes [1] and [doc:1] does not exist: a one-phase
        // replace of "doc:2"→"1" then "doc:1"→… would corrupt the text.
        let refs = vec![r(2, "b"), r(3, "c")];
        let out = render("x [doc:3] y [doc:2]", &refs);
        assert_eq!(out.text, "x [2] y [1]");
    }

    #[test]
    fn no_markers_no_list() {
        let out = render("plain", &[r(1, "a")]);
        assert_eq!(out.to_markdown(), "plain");
    }
}
