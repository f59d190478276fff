//! Prices: USD per million tokens by model, the `[prices."<model>"]`
//! tables of the fleet's configuration file, which turn a call's
//! [`Usage`] into its cost (in `completed` events and metrics).
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[prices."<model>"]` | table | USD per million tokens, for cost in `completed` events and metrics |
//! | `input` | number ≥ 0, required | uncached prompt tokens |
//! | `cached_input` | number ≥ 0, `input` | prompt tokens served from the provider's cache |
//! | `output` | number ≥ 0, required | completion tokens, reasoning tokens included |
//!
//! Cached prompt tokens are what the provider's usage reports as served
//! from its prompt cache (`prompt_tokens_details.cached_tokens`, Responses
//! `input_tokens_details.cached_tokens`); how the fleet keeps requests
//! cacheable is docs/prompt-caching.md.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::Usage;
use crate::config_file::key_segment;

/// USD per million tokens for one model.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Uncached prompt tokens.
    pub input: f64,
    /// Prompt tokens served from the provider's cache; `input` when unset.
    #[serde(default)]
    pub cached_input: Option<f64>,
    /// Completion tokens, reasoning tokens included.
    pub output: f64,
}

impl Price {
    /// USD for `usage`. Cached prompt tokens are billed at `cached_input`
    /// and not again at `input`; reasoning tokens are already part of the
    /// completion tokens and are not added again.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        let uncached = usage.prompt_tokens - cached;
        let cached_price = self.cached_input.unwrap_or(self.input);
        // u64 → f64 is exact below 2^53 tokens, which no bill reaches.
        (uncached as f64 * self.input
            + cached as f64 * cached_price
            + usage.completion_tokens as f64 * self.output)
            / 1_000_000.0
    }

    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        for (key, value) in [
            ("input", Some(self.input)),
            ("cached_input", self.cached_input),
            ("output", Some(self.output)),
        ] {
            if let Some(v) = value
                && (!v.is_finite() || v < 0.0)
            {
                return Err((
                    format!("{at}.{key}"),
                    format!("must be a price of 0 or more, not {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// Prices by model name.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct PriceTable {
    prices: BTreeMap<String, Price>,
}

impl PriceTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, model: impl Into<String>, price: Price) {
        self.prices.insert(model.into(), price);
    }

    /// The price of `model`: its own entry, else, for a dated snapshot such
    /// as `gpt-4o-mini-2024-07-18` (what providers report back), the entry
    /// of the name without the date. Other near matches are not guessed:
    /// `gpt-4o-audio-preview` is not priced as `gpt-4o`.
    pub fn get(&self, model: &str) -> Option<&Price> {
        self.prices
            .get(model)
            .or_else(|| strip_date_suffix(model).and_then(|base| self.prices.get(base)))
    }

    /// USD for `usage` on `model`; `None` when the model has no price.
    pub fn cost(&self, model: &str, usage: &Usage) -> Option<f64> {
        self.get(model).map(|price| price.cost(usage))
    }

    pub fn is_empty(&self) -> bool {
        self.prices.is_empty()
    }

    pub fn len(&self) -> usize {
        self.prices.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Price)> {
        self.prices.iter()
    }

    /// Checks every price of a file; the error is `(key path, message)` of
    /// the first problem.
    ///
    /// # Errors
    ///
    /// An empty model name or a price that is negative or not finite.
    pub fn validate(&self) -> Result<(), (String, String)> {
        for (model, price) in self.iter() {
            let at = format!("prices.{}", key_segment(model));
            if model.is_empty() {
                return Err((at, "the model name is empty".to_owned()));
            }
            price.validate(&at)?;
        }
        Ok(())
    }
}

/// `name` without a trailing `-YYYY-MM-DD`.
fn strip_date_suffix(model: &str) -> Option<&str> {
    const SUFFIX: usize = "-2024-07-18".len();
    let split = model.len().checked_sub(SUFFIX)?;
    let (base, date) = (model.get(..split)?, model.get(split..)?);
    let bytes = date.as_bytes();
    let shape = bytes.iter().enumerate().all(|(i, b)| match i {
        0 | 5 | 8 => *b == b'-',
        _ => b.is_ascii_digit(),
    });
    (shape && !base.is_empty()).then_some(base)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_config::ModelConfig;

    const EXAMPLE: &str = include_str!("../../../config/toolfleet.example.toml");

    #[test]
    fn cost_bills_cached_tokens_once_and_reasoning_not_again() {
        let config = ModelConfig::from_toml(EXAMPLE, "example").expect("loads");
        let usage = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 500_000,
            total_tokens: 1_500_000,
            cached_tokens: 400_000,
            reasoning_tokens: 200_000,
        };
        // gpt-4o-mini in the example: 0.15 input, 0.075 cached, 0.60 output.
        let cost = config.prices.cost("gpt-4o-mini", &usage).expect("priced");
        let expected = 0.6 * 0.15 + 0.4 * 0.075 + 0.5 * 0.60;
        assert!((cost - expected).abs() < 1e-9, "{cost} != {expected}");
    }

    #[test]
    fn cost_of_unknown_model_is_none_and_snapshots_use_their_base_price() {
        let mut prices = PriceTable::new();
        let price = Price {
            input: 2.0,
            cached_input: None,
            output: 8.0,
        };
        prices.insert("gpt-4o", price);
        let usage = Usage {
            prompt_tokens: 1000,
            completion_tokens: 100,
            total_tokens: 1100,
            cached_tokens: 1000,
            reasoning_tokens: 0,
        };
        // No cached price: cached tokens cost the input price.
        let cost = prices.cost("gpt-4o", &usage).expect("priced");
        assert!((cost - (1000.0 * 2.0 + 100.0 * 8.0) / 1e6).abs() < 1e-12);
        assert_eq!(prices.cost("gpt-4o-2024-08-06", &usage), Some(cost));
        assert_eq!(prices.cost("gpt-4o-audio-preview", &usage), None);
        assert_eq!(prices.cost("llama3.1:8b", &usage), None);
        assert_eq!(prices.cost("-2024-08-06", &usage), None);
        // More cached than prompt tokens (a provider bug) is not billed twice.
        let odd = Usage {
            cached_tokens: 5000,
            ..usage
        };
        assert_eq!(prices.cost("gpt-4o", &odd), Some(cost));
    }
}
