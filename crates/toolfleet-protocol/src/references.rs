//! The `[doc:N]` markers: the one scanner and the reader-side renderer.
//!
//! Tools and preemptive retrieval cite passages as `[doc:N]`, where `N` comes
//! from the invocation's shared counter in the store. A reader sees only the
//! references cited in the text, renumbered 1..k.

use std::collections::BTreeMap;

use crate::Reference;

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

/// `text` with every `[doc:N]` marker renumbered: `[doc:map(N)]`, or no
/// marker at all when `map` does not know `N` (a marker that cites nothing
/// in the new numbering would cite some other document there). The same
/// scanner as [`cited_indices`], so both agree on what a marker is.
pub fn renumber(text: &str, map: impl Fn(u64) -> Option<u64>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[doc:") {
        let after = &rest[start + 5..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && after[digits..].starts_with(']') {
            out.push_str(&rest[..start]);
            if let Some(n) = after[..digits].parse().ok().and_then(&map) {
                out.push_str(&format!("[doc:{n}]"));
            }
            rest = &after[digits + 1..];
        } else {
            out.push_str(&rest[..start + 5]);
            rest = after;
        }
    }
    out.push_str(rest);
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
    remap(text, references, |d| format!("[{d}]"))
}

/// The answer as the `completed` event carries it: only the references
/// cited in `text`, renumbered 1..k (by their order of index) and the text's
/// markers rewritten to match, still as `[doc:k]` — the same two phases as
/// [`render`], so a reader that renders it again gets the same numbers.
pub fn cited_only(text: &str, references: &[Reference]) -> Rendered {
    remap(text, references, |d| format!("[doc:{d}]"))
}

fn remap(text: &str, references: &[Reference], marker: impl Fn(usize) -> String) -> Rendered {
    // NUL separates placeholders below: a NUL in the text would shift them.
    let cleaned;
    let text = if text.contains('\u{0}') {
        cleaned = text.replace('\u{0}', "");
        cleaned.as_str()
    } else {
        text
    };
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
            out.push_str(&marker(p.parse().unwrap_or(0)));
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

    #[test]
    fn renumber_maps_known_markers_and_drops_unknown_ones() {
        let text = "a [doc:1] b [doc:2][doc:1] [doc:9] [doc:x] [doc:3";
        let out = renumber(text, |n| match n {
            1 => Some(7),
            2 => Some(8),
            _ => None,
        });
        assert_eq!(out, "a [doc:7] b [doc:8][doc:7]  [doc:x] [doc:3");
        assert_eq!(cited_indices(&out), [7, 8, 7]);
        assert_eq!(renumber("no markers", |_| Some(1)), "no markers");
    }
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
    fn the_completed_answer_keeps_only_cited_references_as_doc_markers() {
        let refs = [r(3, "three"), r(7, "seven"), r(9, "nine")];
        let out = cited_only("A [doc:9], b [doc:3] and [doc:9]; c [doc:5].", &refs);
        assert_eq!(out.text, "A [doc:2], b [doc:1] and [doc:2]; c.");
        let titles: Vec<(u64, &str)> = out
            .references
            .iter()
            .map(|r| (r.index, r.title.as_str()))
            .collect();
        assert_eq!(titles, [(1, "three"), (2, "nine")]);
        // Rendering it again changes nothing but the marker style.
        let again = render(&out.text, &out.references);
        assert_eq!(again.text, "A [2], b [1] and [2]; c.");
        assert_eq!(again.references, out.references);
    }

    #[test]
    fn a_nul_in_the_answer_cannot_shift_the_markers() {
        let out = cited_only("x\u{0}y [doc:1]", &[r(1, "one")]);
        assert_eq!(out.text, "xy [doc:1]");
        assert_eq!(out.references.len(), 1);
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

    #[test]
    fn the_reader_sees_a_numbered_list_with_links() {
        let mut wiki = r(4, "Fog");
        wiki.url = Some("https://wiki.example.com/fog.md".into());
        let out = render("Fog [doc:4], bees [doc:2].", &[r(2, "Bees"), wiki]);
        assert_eq!(
            out.to_markdown(),
            "Fog [2], bees [1].\n\nReferences:\n[1] Bees — Bees.md\n[2] Fog — Fog.md <https://wiki.example.com/fog.md>\n"
        );
    }
}
