//! Token usage of model calls: the one type events, the LLM client and
//! the cost table share.

use std::ops::AddAssign;

use serde::{Deserialize, Serialize};

/// Token counts for one call, or summed over many with `+=`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Chat `prompt_tokens`, Responses `input_tokens`.
    pub prompt_tokens: u64,
    /// Chat `completion_tokens`, Responses `output_tokens`.
    pub completion_tokens: u64,
    /// Prompt and completion tokens together, as the provider reports them.
    pub total_tokens: u64,
    /// The part of the prompt served from the provider's prompt cache
    /// (`prompt_tokens_details` / `input_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// `completion_tokens_details` / `output_tokens_details.reasoning_tokens`.
    pub reasoning_tokens: u64,
}

impl AddAssign for Usage {
    fn add_assign(&mut self, other: Self) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.total_tokens += other.total_tokens;
        self.cached_tokens += other.cached_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
    }
}
