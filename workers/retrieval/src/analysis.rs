//! The text analysis shared by the tantivy backend's index and its
//! queries: one analyzer (registered under [`TOKENIZER`]) so that the index
//! and a query agree on what a word is, and query sanitising so that no
//! text a model or user writes is read as query syntax.

use std::collections::HashSet;

use tantivy::tokenizer::{
    AsciiFoldingFilter, LowerCaser, RemoveLongFilter, SimpleTokenizer, StopWordFilter,
    TextAnalyzer, Token, TokenFilter, TokenStream, Tokenizer,
};

/// Name under which the analyzer is registered. Tokenizers are not stored
/// in an index, so opening one registers it again under this name.
pub const TOKENIZER: &str = "toolfleet_en";

/// Longer tokens (hashes, base64) are dropped.
const MAX_TOKEN_BYTES: usize = 40;

/// Words too common to tell documents apart. Removing them matters for
/// question-shaped queries ("how do bees find flowers"), which is what models
/// and users send. Small on purpose: tantivy's own lists are behind a feature
/// this crate does not enable.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "can", "did", "do", "does", "for",
    "from", "had", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its", "me", "my",
    "no", "not", "of", "on", "or", "so", "such", "than", "that", "the", "their", "them", "then",
    "there", "these", "they", "this", "to", "was", "we", "were", "what", "when", "where", "which",
    "who", "why", "will", "with", "would", "you", "your",
];

/// The analyzer of every searchable field and of queries: words split on
/// non-alphanumerics, lowercased, accents folded, stop words dropped, plurals
/// reduced to singular.
pub fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(AsciiFoldingFilter)
        .filter(StopWordFilter::remove(
            STOP_WORDS.iter().map(|word| (*word).to_owned()),
        ))
        .filter(PluralFilter)
        .build()
}

/// Keeps words, balanced double quotes (phrases) and nothing else, so that
/// no text a model or user writes is read as field names, ranges, boosts,
/// exclusions or wildcards. `AND`, `OR` and `NOT` are lowercased into plain
/// (stop) words: a model that writes "bees AND NOT wasps" means words, and a
/// purely negative query would otherwise match every document.
pub fn sanitize_query(raw: &str) -> String {
    let unified: String = raw
        .chars()
        .map(|c| match c {
            '\u{201c}' | '\u{201d}' | '\u{201e}' => '"',
            c => c,
        })
        .collect();
    let balanced = unified.matches('"').count().is_multiple_of(2);
    let kept: String = unified
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || (c == '"' && balanced) {
                c
            } else {
                ' '
            }
        })
        .collect();
    kept.split(' ')
        .map(|word| match word {
            "AND" | "OR" | "NOT" => word.to_ascii_lowercase(),
            _ => word.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The analyzed terms of `text`, as the index sees them.
pub fn terms(analyzer: &mut TextAnalyzer, text: &str) -> HashSet<String> {
    let mut stream = analyzer.token_stream(text);
    let mut out = HashSet::new();
    while stream.advance() {
        out.insert(stream.token().text.clone());
    }
    out
}

// A light English plural stemmer (Harman's "S" stemmer).

/// Reduces English plurals to their singular (`bees` → `bee`, `colonies` →
/// `colony`), so a question about "flowers" finds a text about a "flower".
/// Deliberately light: a full stemmer is behind a tantivy feature this crate
/// does not enable, and plurals are most of the benefit. Indexing and
/// queries both run it, so its quirks (`lens` → `len`) cancel out.
#[derive(Clone)]
struct PluralFilter;

impl TokenFilter for PluralFilter {
    type Tokenizer<T: Tokenizer> = PluralFilterTokenizer<T>;

    fn transform<T: Tokenizer>(self, tokenizer: T) -> PluralFilterTokenizer<T> {
        PluralFilterTokenizer { inner: tokenizer }
    }
}

#[derive(Clone)]
struct PluralFilterTokenizer<T> {
    inner: T,
}

impl<T: Tokenizer> Tokenizer for PluralFilterTokenizer<T> {
    type TokenStream<'a> = PluralFilterStream<T::TokenStream<'a>>;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> Self::TokenStream<'a> {
        PluralFilterStream {
            tail: self.inner.token_stream(text),
        }
    }
}

struct PluralFilterStream<T> {
    tail: T,
}

impl<T: TokenStream> TokenStream for PluralFilterStream<T> {
    fn advance(&mut self) -> bool {
        if !self.tail.advance() {
            return false;
        }
        singularize(&mut self.tail.token_mut().text);
        true
    }

    fn token(&self) -> &Token {
        self.tail.token()
    }

    fn token_mut(&mut self) -> &mut Token {
        self.tail.token_mut()
    }
}

fn singularize(word: &mut String) {
    // Short words ("gas", "bus", "its") are rarely plurals; non-ASCII words
    // are left alone because the rules are English and byte-based.
    if word.len() <= 3 || !word.is_ascii() {
        return;
    }
    let len = word.len();
    if word.ends_with("ies") && !word.ends_with("eies") && !word.ends_with("aies") {
        word.truncate(len - 3);
        word.push('y');
    } else if word.ends_with('s') && !word.ends_with("us") && !word.ends_with("ss") {
        // Harman's "es" → "e" rule and its "s" → "" rule both drop the final
        // "s", so they are one branch here.
        word.truncate(len - 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_syntax_is_neutralised() {
        assert_eq!(sanitize_query("title:(bees)"), "title  bees ");
        assert_eq!(sanitize_query("\"red kite\" -x"), "\"red kite\"  x");
        assert_eq!(sanitize_query("\"odd"), " odd");
        assert_eq!(sanitize_query("“curly”"), "\"curly\"");
        assert_eq!(sanitize_query("bees AND NOT wasps"), "bees and not wasps");
    }

    #[test]
    fn plurals_become_singular() {
        let cases = [
            ("bees", "bee"),
            ("flowers", "flower"),
            ("colonies", "colony"),
            ("boxes", "boxe"),
            ("glass", "glass"),
            ("virus", "virus"),
            ("gas", "gas"),
            ("canoes", "canoe"),
        ];
        for (word, expected) in cases {
            let mut word = word.to_owned();
            singularize(&mut word);
            assert_eq!(word, expected);
        }
        let mut analyzer = analyzer();
        let found = terms(&mut analyzer, "How do the Bees find FLOWERS");
        assert_eq!(
            found,
            HashSet::from(["bee".to_owned(), "find".to_owned(), "flower".to_owned()])
        );
    }
}
