//! Token-aware chunking with tiktoken's `o200k_base` encoding (the one
//! GPT-4o and later models count with): windows of `max_tokens` tokens,
//! each starting `max_tokens - overlap_tokens` tokens after the previous
//! one, so that a sentence cut by one window is whole in the next.
//!
//! The text is encoded once; each token's byte length gives the byte offset
//! of every token boundary, and a chunk is the slice of the original text
//! between two boundaries (snapped outward to character boundaries where a
//! multi-byte character spans two tokens). A chunk is therefore always a
//! substring of the text, never re-decoded, and its window holds exactly
//! `max_tokens` tokens except the last.

use std::ops::Range;

use tiktoken_rs::CoreBPE;

/// Default tokens per chunk.
pub const DEFAULT_MAX_TOKENS: usize = 500;
/// Default tokens shared by consecutive chunks.
pub const DEFAULT_OVERLAP_TOKENS: usize = 50;
/// The largest chunk allowed (models' embedding inputs stop at 8191).
pub const MAX_CHUNK_TOKENS: usize = 8000;

/// How text is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkConfig {
    max_tokens: usize,
    overlap_tokens: usize,
}

/// A chunk size or overlap that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChunkConfigError {
    /// Zero or above [`MAX_CHUNK_TOKENS`].
    #[error("chunk size must be 1 to {MAX_CHUNK_TOKENS} tokens, not {0}")]
    Size(usize),
    /// The overlap must leave every window at least one new token.
    #[error("chunk overlap ({overlap}) must be smaller than the chunk size ({size})")]
    Overlap {
        /// The overlap asked for.
        overlap: usize,
        /// The chunk size.
        size: usize,
    },
}

impl Default for ChunkConfig {
    fn default() -> Self {
        Self {
            max_tokens: DEFAULT_MAX_TOKENS,
            overlap_tokens: DEFAULT_OVERLAP_TOKENS,
        }
    }
}

impl ChunkConfig {
    /// A checked configuration.
    pub fn new(max_tokens: usize, overlap_tokens: usize) -> Result<Self, ChunkConfigError> {
        if max_tokens == 0 || max_tokens > MAX_CHUNK_TOKENS {
            return Err(ChunkConfigError::Size(max_tokens));
        }
        if overlap_tokens >= max_tokens {
            return Err(ChunkConfigError::Overlap {
                overlap: overlap_tokens,
                size: max_tokens,
            });
        }
        Ok(Self {
            max_tokens,
            overlap_tokens,
        })
    }

    /// Tokens per chunk.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Tokens shared by consecutive chunks.
    pub fn overlap_tokens(&self) -> usize {
        self.overlap_tokens
    }
}

/// One chunk of a text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its bytes in the text (on character boundaries).
    pub bytes: Range<usize>,
    /// Its token window in the text's encoding.
    pub tokens: Range<usize>,
}

/// The encoding, built once per process (building it takes tens of ms).
pub fn encoding() -> &'static CoreBPE {
    tiktoken_rs::o200k_base_singleton()
}

/// The byte length of every token of the encoding, by rank, decoded once
/// per process: chunking looks lengths up instead of decoding each token.
fn token_lengths() -> &'static [u32] {
    static LENGTHS: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    LENGTHS.get_or_init(|| {
        let bpe = encoding();
        // o200k_base ranks run below 200,019 (special tokens included).
        (0..200_019u32)
            .map(|rank| bpe.decode_bytes(&[rank]).map_or(0, |b| b.len() as u32))
            .collect()
    })
}

/// How many `o200k_base` tokens `text` is.
pub fn count_tokens(text: &str) -> usize {
    encoding().encode_ordinary(text).len()
}

/// Cuts `text` into chunks; an empty text has none.
pub fn chunk(text: &str, config: ChunkConfig) -> Vec<Chunk> {
    let bpe = encoding();
    let tokens = bpe.encode_ordinary(text);
    if tokens.is_empty() {
        return Vec::new();
    }
    // offsets[i] is where token i starts; offsets[n] is the end.
    let lengths = token_lengths();
    let mut offsets = Vec::with_capacity(tokens.len() + 1);
    let mut at = 0usize;
    offsets.push(0);
    for token in &tokens {
        // Every token of an encoding has a length; an impossible miss
        // counts zero bytes and only shifts a boundary, which snapping
        // keeps valid.
        let len = match lengths.get(*token as usize) {
            Some(&len) => len as usize,
            None => bpe.decode_bytes(&[*token]).map_or(0, |b| b.len()),
        };
        at += len;
        offsets.push(at.min(text.len()));
    }
    *offsets.last_mut().expect("pushed above") = text.len();

    let step = config.max_tokens - config.overlap_tokens;
    let mut chunks = Vec::new();
    let mut start = 0usize;
    loop {
        let end = (start + config.max_tokens).min(tokens.len());
        let from = floor_char_boundary(text, offsets[start]);
        let to = ceil_char_boundary(text, offsets[end]);
        chunks.push(Chunk {
            bytes: from..to,
            tokens: start..end,
        });
        if end == tokens.len() {
            break;
        }
        start += step;
    }
    chunks
}

fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn ceil_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prose(words: usize) -> String {
        let vocabulary = [
            "refund",
            "policy",
            "customers",
            "return",
            "items",
            "within",
            "thirty",
            "days",
            "receipt",
            "store",
            "credit",
            "exchange",
            "manager",
            "approval",
            "warranty",
        ];
        (0..words)
            .map(|i| vocabulary[(i * 7 + i / 3) % vocabulary.len()])
            .collect::<Vec<_>>()
            .join(" ")
            + "."
    }

    #[test]
    fn default_chunks_are_500_tokens_overlapping_by_50() {
        let text = prose(3000);
        let total = count_tokens(&text);
        assert!(total > 1500, "{total}");
        let chunks = chunk(&text, ChunkConfig::default());
        let bpe = encoding();
        let all = bpe.encode_ordinary(&text);
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let window = c.tokens.len();
            if last {
                assert!(window <= 500 && window > 50, "last window {window}");
                assert_eq!(c.tokens.end, total);
            } else {
                assert_eq!(window, 500, "chunk {i}");
            }
            // The chunk's text is exactly its window's tokens...
            let decoded = bpe.decode(&all[c.tokens.clone()]).unwrap();
            assert_eq!(&text[c.bytes.clone()], decoded);
            // ...and, counted again on its own, within a token of the window
            // (only a cut word's edge may merge differently).
            let recount = count_tokens(&text[c.bytes.clone()]);
            assert!(
                recount.abs_diff(window) <= 1,
                "chunk {i}: {recount} vs {window}"
            );
            if i > 0 {
                let previous = &chunks[i - 1];
                assert_eq!(previous.tokens.end - c.tokens.start, 50, "overlap {i}");
                let shared = &text[c.bytes.start..previous.bytes.end];
                assert_eq!(bpe.encode_ordinary(shared).len(), 50, "shared text {i}");
            }
        }
        assert_eq!(chunks[0].tokens.start, 0);
        assert_eq!(chunks.len(), (total - 50).div_ceil(450));
    }

    #[test]
    fn the_size_and_overlap_are_configurable_and_checked() {
        let text = prose(400);
        let config = ChunkConfig::new(100, 10).unwrap();
        let chunks = chunk(&text, config);
        assert!(chunks.len() >= 4);
        for pair in chunks.windows(2) {
            assert_eq!(pair[0].tokens.len(), 100);
            assert_eq!(pair[1].tokens.start, pair[0].tokens.start + 90);
        }
        assert_eq!(ChunkConfig::new(0, 0), Err(ChunkConfigError::Size(0)));
        assert_eq!(ChunkConfig::new(9000, 0), Err(ChunkConfigError::Size(9000)));
        assert_eq!(
            ChunkConfig::new(100, 100),
            Err(ChunkConfigError::Overlap {
                overlap: 100,
                size: 100
            })
        );
        // No overlap is allowed: windows then tile the text.
        let tiles = chunk(&text, ChunkConfig::new(64, 0).unwrap());
        let joined: String = tiles.iter().map(|c| &text[c.bytes.clone()]).collect();
        assert_eq!(joined, text);
    }

    #[test]
    fn a_short_or_empty_text_makes_one_or_no_chunk() {
        assert!(chunk("", ChunkConfig::default()).is_empty());
        let one = chunk("Hello, world.", ChunkConfig::default());
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].bytes, 0..13);
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        // Emoji and CJK are several tokens per character in places.
        let text = "数据检索🙂🧪 ünïcödé ".repeat(300);
        let chunks = chunk(&text, ChunkConfig::new(37, 5).unwrap());
        assert!(chunks.len() > 10);
        for c in &chunks {
            assert!(text.is_char_boundary(c.bytes.start) && text.is_char_boundary(c.bytes.end));
            assert!(!text[c.bytes.clone()].is_empty());
        }
        assert_eq!(chunks.last().unwrap().bytes.end, text.len());
    }
}
