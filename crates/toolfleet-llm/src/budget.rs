//! The tool-result token cap: a tool result longer than a profile's
//! `max_tool_result_tokens` is cut in the middle, keeping a head and a tail,
//! with a notice the model can read saying how much was cut.
//!
//! Tokens are counted with the model's own encoding (tiktoken-rs), falling
//! back to `o200k_base` for models tiktoken does not know (local models,
//! Azure deployment names): any BPE count is a far better estimate of a
//! provider's count than bytes, and the cap only needs to be roughly right
//! for a model that does not share an OpenAI encoding.
//!
//! # Invariants
//!
//! - **Tokenize only when the byte length could exceed the cap.** A token is
//!   at least one byte, so a text of at most `max_tokens` bytes is returned
//!   as is without being tokenized; this is the common case and costs
//!   nothing. Counting the tokens of a 10 KiB result costs more than a NATS
//!   round trip, so it is paid only when a cut is possible.
//! - **Encoders are built once per process and shared.** tiktoken-rs keeps
//!   one `&'static` encoder per encoding (built on first use, tens of
//!   milliseconds); [`TokenBudget`] only holds a reference to it, so cloning
//!   one, or building one after the first, is cheap. Build the
//!   budgets at start-up so no job pays for the first build.
//! - **A capped result is at most `max_tokens` tokens** when encoded again
//!   on its own (the cut is verified, not estimated), and it is valid UTF-8
//!   cut only at character boundaries: the head is a prefix and the tail a
//!   suffix of the original text.

use std::fmt;

use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
use tiktoken_rs::{CoreBPE, Rank};

/// The encoding used for models tiktoken does not know.
pub const FALLBACK_ENCODING: Tokenizer = Tokenizer::O200kBase;

/// The smallest cap a profile may configure: below it the notice alone
/// would take most of the room and the model would see almost nothing.
pub const MIN_CAP_TOKENS: usize = 64;

/// Share of the content budget given to the head; the rest goes to the
/// tail. The head usually carries the answer (titles, first matches), the
/// tail the totals and error summaries.
const HEAD_NUMERATOR: usize = 2;
const HEAD_DENOMINATOR: usize = 3;

/// The notice used when the full one does not fit in the cap.
const SHORT_NOTICE: &str = "\n[… cut …]\n";

/// Counts and caps tokens for one model's encoding. Cheap to clone and to
/// build once the encoding has been built in this process.
#[derive(Clone)]
pub struct TokenBudget {
    bpe: &'static CoreBPE,
    encoding: Tokenizer,
    /// How many times a text was tokenized: lets the tests prove the fast
    /// path never tokenizes.
    #[cfg(test)]
    tokenizations: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl fmt::Debug for TokenBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenBudget")
            .field("encoding", &self.encoding_name())
            .finish()
    }
}

/// A tool result after [`TokenBudget::cap`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capped {
    /// The text to give the model: the original, or head + notice + tail.
    pub text: String,
    /// Whether anything was cut.
    pub truncated: bool,
    /// Tokens in the original text; `None` when it was short enough in bytes
    /// not to need counting.
    pub original_tokens: Option<usize>,
}

/// Which notice separates head and tail, from most to least informative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Notice {
    Full,
    Short,
    None,
}

impl TokenBudget {
    /// The budget for `model`'s encoding, or [`FALLBACK_ENCODING`] when
    /// tiktoken does not know the model. The first call for an encoding
    /// builds its encoder (tens of milliseconds); later calls share it.
    pub fn for_model(model: &str) -> Self {
        Self::for_encoding(get_tokenizer(model).unwrap_or(FALLBACK_ENCODING))
    }

    /// The budget for one encoding.
    pub fn for_encoding(encoding: Tokenizer) -> Self {
        // The `*_singleton` functions build each encoder once per process
        // (a `LazyLock`), which is the cache keyed by encoding we need.
        let bpe = match encoding {
            Tokenizer::O200kHarmony => tiktoken_rs::o200k_harmony_singleton(),
            Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton(),
            Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
            Tokenizer::P50kBase => tiktoken_rs::p50k_base_singleton(),
            Tokenizer::P50kEdit => tiktoken_rs::p50k_edit_singleton(),
            Tokenizer::R50kBase | Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton(),
        };
        Self {
            bpe,
            encoding,
            #[cfg(test)]
            tokenizations: Default::default(),
        }
    }

    /// The encoding in use.
    pub fn encoding(&self) -> Tokenizer {
        self.encoding
    }

    /// The encoding's tiktoken name, e.g. `o200k_base`.
    pub fn encoding_name(&self) -> &'static str {
        match self.encoding {
            Tokenizer::O200kHarmony => "o200k_harmony",
            Tokenizer::O200kBase => "o200k_base",
            Tokenizer::Cl100kBase => "cl100k_base",
            Tokenizer::P50kBase => "p50k_base",
            Tokenizer::P50kEdit => "p50k_edit",
            Tokenizer::R50kBase => "r50k_base",
            Tokenizer::Gpt2 => "gpt2",
        }
    }

    /// Tokens in `text`. Special-token text such as `<|endoftext|>` counts
    /// as ordinary text, as it does in a message sent to the provider.
    pub fn count(&self, text: &str) -> usize {
        self.encode(text).len()
    }

    /// `text` cut to at most `max_tokens` tokens: unchanged when it fits,
    /// otherwise a head (about 2/3 of the room) and a tail (about 1/3)
    /// around a notice such as
    /// `[… 1234 tokens cut from the middle of this tool result to fit the
    /// limit of 2000 tokens …]`. With a cap too small for that notice a
    /// shorter one is used, and with a cap too small even for that only the
    /// head is kept (profiles cannot configure less than
    /// [`MIN_CAP_TOKENS`], so this is for direct callers).
    pub fn cap(&self, text: &str, max_tokens: usize) -> Capped {
        // A token is at least one byte.
        if text.len() <= max_tokens {
            return Capped {
                text: text.to_owned(),
                truncated: false,
                original_tokens: None,
            };
        }
        let tokens = self.encode(text);
        let total = tokens.len();
        if total <= max_tokens {
            return Capped {
                text: text.to_owned(),
                truncated: false,
                original_tokens: Some(total),
            };
        }
        Capped {
            text: self.cut_middle(text, &tokens, max_tokens),
            truncated: true,
            original_tokens: Some(total),
        }
    }

    fn encode(&self, text: &str) -> Vec<Rank> {
        #[cfg(test)]
        self.tokenizations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.bpe.encode_ordinary(text)
    }

    /// Bytes the `tokens` decode to. `tokens` come from encoding a `&str`,
    /// so decoding cannot fail; if it ever did, one byte per token is a safe
    /// under-estimate (the cut would keep less, never more).
    fn byte_len(&self, tokens: &[Rank]) -> usize {
        self.bpe
            .decode_bytes(tokens)
            .map_or(tokens.len(), |bytes| bytes.len())
    }

    /// Head + notice + tail of at most `max_tokens` tokens, for a `text`
    /// of `tokens.len() > max_tokens` tokens.
    fn cut_middle(&self, text: &str, tokens: &[Rank], max_tokens: usize) -> String {
        let total = tokens.len();
        // The cut count is below `total`, so the notice written with `total`
        // is (for every tiktoken encoding, which splits digits into short
        // runs) at least as long in tokens as the one finally written.
        let full_cost = self.count(&full_notice(total, max_tokens));
        let short_cost = self.count(SHORT_NOTICE);
        // The full notice only when it leaves the model a useful amount of
        // content beside it.
        let mut notice = if max_tokens >= 2 * full_cost {
            Notice::Full
        } else if max_tokens >= 2 * short_cost {
            Notice::Short
        } else {
            Notice::None
        };
        loop {
            let cost = match notice {
                Notice::Full => full_cost,
                Notice::Short => short_cost,
                Notice::None => 0,
            };
            let mut content = max_tokens.saturating_sub(cost);
            loop {
                let out = self.assemble(text, tokens, content, notice, max_tokens);
                // Re-encoding the joined text can merge or split tokens at
                // the joins, so the result is measured, not assumed.
                let used = self.count(&out);
                if used <= max_tokens {
                    return out;
                }
                if content == 0 {
                    break;
                }
                content = content.saturating_sub((used - max_tokens).max(1));
            }
            // Even the notice alone does not fit: fall back to a smaller
            // one. `Notice::None` with no content is the empty string, which
            // always fits, so this ends.
            notice = match notice {
                Notice::Full => Notice::Short,
                Notice::Short | Notice::None => Notice::None,
            };
        }
    }

    /// The head of `content * 2/3` tokens and the tail of the rest, cut at
    /// character boundaries, joined by `notice`.
    fn assemble(
        &self,
        text: &str,
        tokens: &[Rank],
        content: usize,
        notice: Notice,
        max_tokens: usize,
    ) -> String {
        let total = tokens.len();
        let (head_n, tail_n) = match notice {
            // Without a notice there is no middle to mark: keep the head.
            Notice::None => (content.min(total), 0),
            Notice::Full | Notice::Short => {
                let head = content * HEAD_NUMERATOR / HEAD_DENOMINATOR;
                (head, content - head)
            }
        };
        // A token may hold part of a multi-byte character: the head ends at
        // the last character boundary inside its tokens, the tail starts at
        // the first one inside its tokens, so no character is ever split.
        let mut head_end = self.byte_len(&tokens[..head_n]).min(text.len());
        let mut head_kept = head_n;
        if !text.is_char_boundary(head_end) {
            head_kept = head_kept.saturating_sub(1);
            while !text.is_char_boundary(head_end) {
                head_end -= 1;
            }
        }
        let tail_len = self
            .byte_len(&tokens[total - tail_n..])
            .min(text.len() - head_end);
        let mut tail_start = text.len() - tail_len;
        let mut tail_kept = tail_n;
        if !text.is_char_boundary(tail_start) {
            tail_kept = tail_kept.saturating_sub(1);
            while !text.is_char_boundary(tail_start) {
                tail_start += 1;
            }
        }
        let middle = match notice {
            Notice::Full => full_notice(total - head_kept - tail_kept, max_tokens),
            Notice::Short => SHORT_NOTICE.to_owned(),
            Notice::None => String::new(),
        };
        let mut out = String::with_capacity(head_end + middle.len() + (text.len() - tail_start));
        out.push_str(&text[..head_end]);
        out.push_str(&middle);
        out.push_str(&text[tail_start..]);
        out
    }
}

/// The notice the model reads in place of the cut middle. On lines of its
/// own so it cannot be mistaken for part of the tool's output.
fn full_notice(cut: usize, max_tokens: usize) -> String {
    format!(
        "\n[… {cut} tokens cut from the middle of this tool result to fit the limit of \
         {max_tokens} tokens …]\n"
    )
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    fn tokenizations(budget: &TokenBudget) -> usize {
        budget.tokenizations.load(Ordering::Relaxed)
    }

    /// Splits a capped text into head and tail around its notice.
    fn head_and_tail(out: &str) -> (&str, &str) {
        let start = out.find("\n[…").expect("a notice");
        let end = out[start..].find("…]\n").expect("the notice's end") + start + "…]\n".len();
        (&out[..start], &out[end..])
    }

    fn numbered_lines(n: usize) -> String {
        (0..n)
            .map(|i| format!("line {i:05}: the quick brown fox jumps over the lazy dog\n"))
            .collect()
    }

    #[test]
    fn short_text_is_returned_without_tokenizing() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let text = "x".repeat(2000);
        let capped = budget.cap(&text, 2000);
        assert_eq!(capped.text, text);
        assert!(!capped.truncated);
        assert_eq!(capped.original_tokens, None);
        assert_eq!(tokenizations(&budget), 0, "the fast path must not tokenize");

        // One byte more and the text could in principle exceed the cap.
        let longer = "x".repeat(2001);
        let capped = budget.cap(&longer, 2000);
        assert_eq!(tokenizations(&budget), 1);
        assert!(!capped.truncated, "2001 x's are far fewer than 2000 tokens");
        assert_eq!(capped.text, longer);
        assert!(capped.original_tokens.is_some_and(|n| n < 2000));
    }

    #[test]
    fn text_at_exactly_the_cap_is_kept_and_one_token_over_is_cut() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let text = numbered_lines(40);
        let n = budget.count(&text);
        assert!(text.len() > n, "the fixture must need tokenizing");

        let exact = budget.cap(&text, n);
        assert!(!exact.truncated);
        assert_eq!(exact.text, text);
        assert_eq!(exact.original_tokens, Some(n));

        let over = budget.cap(&text, n - 1);
        assert!(over.truncated);
        assert_eq!(over.original_tokens, Some(n));
        assert!(budget.count(&over.text) < n);
    }

    #[test]
    fn long_text_keeps_head_and_tail_with_a_notice() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let text = numbered_lines(2000);
        let original = budget.count(&text);
        let capped = budget.cap(&text, 2000);

        assert!(capped.truncated);
        assert_eq!(capped.original_tokens, Some(original));
        assert!(budget.count(&capped.text) <= 2000);
        assert!(capped.text.starts_with("line 00000: the quick brown fox"));
        assert!(
            capped
                .text
                .ends_with("line 01999: the quick brown fox jumps over the lazy dog\n")
        );
        assert!(
            capped.text.contains(
                "tokens cut from the middle of this tool result to fit the limit of 2000 tokens …]"
            ),
            "{}",
            capped.text
        );

        let (head, tail) = head_and_tail(&capped.text);
        assert!(text.starts_with(head));
        assert!(text.ends_with(tail));
        let (head_tokens, tail_tokens) = (budget.count(head), budget.count(tail));
        assert!(
            head_tokens > tail_tokens * 3 / 2 && head_tokens < tail_tokens * 5 / 2,
            "head {head_tokens} and tail {tail_tokens} should be about 2:1"
        );
        // The notice's count is what was actually left out.
        let cut: usize = capped.text[head.len()..]
            .trim_start_matches("\n[… ")
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("a number in the notice");
        let kept = head_tokens + tail_tokens;
        assert!(
            cut.abs_diff(original - kept) <= 2,
            "notice says {cut} cut, {} were",
            original - kept
        );
        // Most of the room goes to content.
        assert!(kept > 1900, "kept only {kept} tokens of content");
    }

    #[test]
    fn multi_byte_text_is_never_split_inside_a_character() {
        let budget = TokenBudget::for_model("gpt-4o");
        let samples = [
            "🦀".repeat(3000),
            "東京都の天気は晴れ、気温は二十度です。".repeat(300),
            "👩‍👩‍👧‍👦 família Ünïcödé ✓ ".repeat(500),
            "a🦀b東c".repeat(1000),
        ];
        for text in &samples {
            for max in [64, 65, 100, 333, 1000] {
                let capped = budget.cap(text, max);
                assert!(capped.truncated, "cap {max}");
                assert!(budget.count(&capped.text) <= max, "cap {max}");
                let (head, tail) = head_and_tail(&capped.text);
                assert!(text.starts_with(head), "cap {max}: head is not a prefix");
                assert!(text.ends_with(tail), "cap {max}: tail is not a suffix");
                assert!(!head.is_empty() && !tail.is_empty(), "cap {max}");
                assert!(!capped.text.contains('\u{FFFD}'));
            }
        }
    }

    #[test]
    fn result_never_exceeds_the_cap() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let texts = [
            numbered_lines(500),
            "1234567890".repeat(2000),
            " \n\t ".repeat(3000),
            "<|endoftext|> special-looking text ".repeat(300),
            "{\"id\": 17, \"title\": \"Quarterly report\", \"score\": 0.93}, ".repeat(400),
        ];
        for text in &texts {
            for max in [
                0,
                1,
                2,
                5,
                10,
                MIN_CAP_TOKENS,
                MIN_CAP_TOKENS + 1,
                257,
                2000,
            ] {
                let capped = budget.cap(text, max);
                let used = budget.count(&capped.text);
                assert!(used <= max, "cap {max}: {used} tokens");
                assert_eq!(
                    capped.truncated,
                    capped.original_tokens.is_some_and(|n| n > max)
                );
            }
        }
    }

    /// Re-joining head, notice and tail can take more tokens than the
    /// parts did (a few in a few hundred of these texts): the cut must
    /// measure and shrink, not trust the arithmetic.
    #[test]
    fn random_text_never_exceeds_the_cap() {
        let budget = TokenBudget::for_model("gpt-4o");
        let alphabet: Vec<char> =
            "abcdefghij klmnop qrstuvwxyz ABC 0123456789 .,;:!?-_/\\'\"()[]{}<>\n\t  東京都の天気🦀é👍🏽"
                .chars()
                .collect();
        // xorshift: deterministic, so a failure reproduces.
        let mut seed: u64 = 42;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for trial in 0..400 {
            let len = 300 + (next() % 3000) as usize;
            let text: String = (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect();
            let max = MIN_CAP_TOKENS + (next() % 300) as usize;
            let capped = budget.cap(&text, max);
            let used = budget.count(&capped.text);
            assert!(
                used <= max,
                "trial {trial}: {used} tokens for a cap of {max}"
            );
        }
    }

    #[test]
    fn tiny_caps_keep_a_prefix_without_notice() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let text = numbered_lines(100);
        assert_eq!(budget.cap(&text, 0).text, "");
        let capped = budget.cap(&text, 5);
        assert!(capped.truncated);
        assert!(!capped.text.is_empty());
        assert!(text.starts_with(&capped.text));
        assert!(budget.count(&capped.text) <= 5);
    }

    #[test]
    fn minimum_cap_still_carries_a_notice() {
        let budget = TokenBudget::for_model("gpt-4o-mini");
        let capped = budget.cap(&numbered_lines(100), MIN_CAP_TOKENS);
        assert!(capped.text.contains("\n[…"), "{}", capped.text);
    }

    #[test]
    fn unknown_models_use_the_fallback_encoding() {
        assert_eq!(
            TokenBudget::for_model("llama3.1:8b").encoding_name(),
            "o200k_base"
        );
        assert_eq!(
            TokenBudget::for_model("my-azure-deployment").encoding(),
            FALLBACK_ENCODING
        );
        assert_eq!(
            TokenBudget::for_model("gpt-4o-mini").encoding_name(),
            "o200k_base"
        );
        assert_eq!(
            TokenBudget::for_model("gpt-4-0613").encoding_name(),
            "cl100k_base"
        );
    }

    #[test]
    fn budgets_share_one_encoder_per_encoding() {
        let a = TokenBudget::for_model("gpt-4o");
        let b = TokenBudget::for_model("some-local-model");
        assert!(std::ptr::eq(a.bpe, b.bpe));
        let c = TokenBudget::for_model("gpt-4");
        assert!(!std::ptr::eq(a.bpe, c.bpe));
    }
}
