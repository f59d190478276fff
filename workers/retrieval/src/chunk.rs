//! Token-aware chunking at paragraph and sentence boundaries, sized in
//! tiktoken's `o200k_base` tokens (the encoding GPT-4o and later count with).
//!
//! The `text-splitter` crate does the cutting: each chunk is the longest run
//! of the largest units that fits in `max_tokens` — whole paragraphs where
//! they fit, else whole sentences, and words only for a sentence longer than
//! a chunk — and the next chunk starts up to `overlap_tokens` tokens back,
//! again on a unit boundary. So a cited passage starts where a sentence
//! starts, where fixed token windows began mid-sentence.
//!
//! A chunk is a substring of the text with its edge whitespace trimmed,
//! never re-decoded; counted on its own it is at most `max_tokens` tokens.

use std::ops::Range;

use text_splitter::TextSplitter;
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
}

/// The encoding, built once per process (building it takes tens of ms).
pub fn encoding() -> &'static CoreBPE {
    tiktoken_rs::o200k_base_singleton()
}

/// How many `o200k_base` tokens `text` is.
pub fn count_tokens(text: &str) -> usize {
    encoding().encode_ordinary(text).len()
}

/// Cuts `text` into chunks; a text of only whitespace has none.
pub fn chunk(text: &str, config: ChunkConfig) -> Vec<Chunk> {
    // `ChunkConfig::new` rules out the overlap the splitter would refuse;
    // were it refused anyway, chunks without overlap are still chunks.
    let split = text_splitter::ChunkConfig::new(config.max_tokens)
        .with_overlap(config.overlap_tokens)
        .unwrap_or_else(|_| text_splitter::ChunkConfig::new(config.max_tokens))
        .with_sizer(encoding());
    TextSplitter::new(split)
        .chunk_indices(text)
        .map(|(start, piece)| Chunk {
            bytes: start..start + piece.len(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCABULARY: [&str; 15] = [
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

    fn words(count: usize, seed: usize) -> Vec<&'static str> {
        (0..count)
            .map(|i| VOCABULARY[((i + seed) * 7 + (i + seed) / 3) % VOCABULARY.len()])
            .collect()
    }

    /// One sentence of `count` words: a capital first letter and a full stop.
    fn sentence(count: usize, seed: usize) -> String {
        let body = words(count, seed).join(" ");
        let mut chars = body.chars();
        let first = chars.next().map(|c| c.to_ascii_uppercase()).unwrap_or('X');
        format!("{first}{}.", chars.as_str())
    }

    /// Paragraphs of 2 to 40 sentences of 8 to 30 words: some fit a chunk
    /// whole, some must be cut between sentences.
    fn document() -> String {
        (0..24)
            .map(|p| {
                (0..2 + (p * 11) % 39)
                    .map(|s| sentence(8 + (p * 5 + s * 3) % 23, p * 31 + s))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect::<Vec<_>>()
            .join("\n\n")
    }

    fn texts<'a>(text: &'a str, chunks: &[Chunk]) -> Vec<&'a str> {
        chunks.iter().map(|c| &text[c.bytes.clone()]).collect()
    }

    /// Whether `at` is where a sentence starts: the text's start, or a
    /// capital after a full stop and whitespace.
    fn starts_a_sentence(text: &str, at: usize) -> bool {
        let before = text[..at].trim_end();
        let capital = text[at..].starts_with(|c: char| c.is_ascii_uppercase());
        capital && (before.is_empty() || before.ends_with('.'))
    }

    /// The tokens `next` repeats from the end of `previous`.
    fn overlap_tokens(text: &str, previous: &Chunk, next: &Chunk) -> usize {
        text.get(next.bytes.start..previous.bytes.end)
            .map_or(0, count_tokens)
    }

    #[test]
    fn chunks_end_at_sentence_ends_within_500_tokens_overlapping_by_at_most_50() {
        let text = document();
        assert!(count_tokens(&text) > 3000, "{}", count_tokens(&text));
        let chunks = chunk(&text, ChunkConfig::default());
        assert!(chunks.len() >= 6, "{}", chunks.len());
        let mut overlapping = 0;
        for (i, c) in chunks.iter().enumerate() {
            let piece = &text[c.bytes.clone()];
            assert!(
                count_tokens(piece) <= 500,
                "chunk {i}: {}",
                count_tokens(piece)
            );
            assert!(
                starts_a_sentence(&text, c.bytes.start),
                "chunk {i}: {piece:.60}"
            );
            assert!(
                piece.ends_with('.'),
                "chunk {i} ends mid-sentence: …{}",
                &piece[piece.len() - 40..]
            );
            if i > 0 {
                let previous = &chunks[i - 1];
                assert!(c.bytes.start > previous.bytes.start);
                if c.bytes.start < previous.bytes.end {
                    overlapping += 1;
                    let shared = overlap_tokens(&text, previous, c);
                    assert!(shared <= 50, "overlap {i}: {shared}");
                } else {
                    // Nothing between two chunks is lost.
                    assert!(text[previous.bytes.end..c.bytes.start].trim().is_empty());
                }
            }
        }
        assert!(
            overlapping > 0,
            "no chunk shares a sentence with the one before"
        );
        assert_eq!(chunks[0].bytes.start, 0);
        assert_eq!(chunks.last().unwrap().bytes.end, text.len());
    }

    #[test]
    fn whole_paragraphs_stay_together_when_they_fit() {
        let text = document();
        let paragraphs: Vec<&str> = text.split("\n\n").collect();
        let chunks = chunk(&text, ChunkConfig::default());
        let pieces = texts(&text, &chunks);
        for paragraph in paragraphs.iter().filter(|p| count_tokens(p) < 450) {
            assert!(
                pieces.iter().any(|piece| piece.contains(paragraph)),
                "a {}-token paragraph was cut: {paragraph:.60}",
                count_tokens(paragraph)
            );
        }
    }

    #[test]
    fn a_sentence_longer_than_a_chunk_is_cut_between_words() {
        let text = sentence(3000, 0);
        let chunks = chunk(&text, ChunkConfig::default());
        assert!(chunks.len() >= 3, "{}", chunks.len());
        for (i, c) in chunks.iter().enumerate() {
            assert!(count_tokens(&text[c.bytes.clone()]) <= 500, "chunk {i}");
            assert!(
                c.bytes.start == 0 || text[..c.bytes.start].ends_with(' '),
                "chunk {i}"
            );
            assert!(c.bytes.end == text.len() || text[c.bytes.end..].starts_with(' '));
            if i > 0 {
                assert!(overlap_tokens(&text, &chunks[i - 1], c) <= 50, "chunk {i}");
            }
        }
    }

    #[test]
    fn the_size_and_overlap_are_configurable_and_checked() {
        let text = document();
        let config = ChunkConfig::new(100, 10).unwrap();
        let chunks = chunk(&text, config);
        assert!(chunks.len() >= 30, "{}", chunks.len());
        for pair in chunks.windows(2) {
            assert!(count_tokens(&text[pair[0].bytes.clone()]) <= 100);
            assert!(overlap_tokens(&text, &pair[0], &pair[1]) <= 10);
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
        // No overlap is allowed: chunks then tile the text, only the
        // whitespace between them left out.
        let tiles = chunk(&text, ChunkConfig::new(64, 0).unwrap());
        let joined: String = texts(&text, &tiles).concat();
        let squeezed: String = text.split_whitespace().collect();
        assert_eq!(joined.split_whitespace().collect::<String>(), squeezed);
        for pair in tiles.windows(2) {
            assert!(pair[0].bytes.end <= pair[1].bytes.start);
        }
    }

    #[test]
    fn a_short_or_empty_text_makes_one_or_no_chunk() {
        assert!(chunk("", ChunkConfig::default()).is_empty());
        let one = chunk("Hello, world.", ChunkConfig::default());
        assert_eq!(one, [Chunk { bytes: 0..13 }]);
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
            assert!(count_tokens(&text[c.bytes.clone()]) <= 37);
        }
        assert_eq!(chunks.last().unwrap().bytes.end, text.trim_end().len());
    }
}
