//! [`UsageLedger`]: the tokens and cost of one invocation's model calls,
//! recorded in the `completed` event and in the token and cost metrics at
//! once, so the two never disagree.

use toolfleet_llm::Usage;
use toolfleet_protocol::LlmCall;

use crate::metrics::OrchestratorMetrics;

/// Token usage and cost of one invocation, per model call.
#[derive(Debug, Default, Clone)]
pub struct UsageLedger {
    total: Usage,
    /// `None` until a call with a known price is recorded.
    cost: Option<f64>,
    calls: Vec<LlmCall>,
}

/// One model call to record.
#[derive(Debug, Clone, Copy)]
pub struct ModelCall<'a> {
    pub model: &'a str,
    /// `conversation`, `planning` or `tool` (a bounded metric label).
    pub purpose: &'a str,
    pub usage: Usage,
    /// From the price table; `None` when the model has no price.
    pub cost: Option<f64>,
    /// HTTP attempts, retries included.
    pub attempts: u32,
}

impl UsageLedger {
    /// Adds a call to the ledger and to the `toolfleet_llm_tokens_total`
    /// and `toolfleet_llm_cost_usd_total` metrics.
    pub fn record(&mut self, metrics: &OrchestratorMetrics, call: ModelCall<'_>) {
        let ModelCall {
            model,
            purpose,
            usage,
            cost,
            attempts,
        } = call;
        for (kind, n) in [
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
            ("cached", usage.cached_tokens),
            ("reasoning", usage.reasoning_tokens),
        ] {
            metrics
                .llm_tokens
                .with_label_values(&[model, kind, purpose])
                .inc_by(n);
        }
        if let Some(c) = cost {
            metrics
                .llm_cost
                .with_label_values(&[model, purpose])
                .inc_by(c);
        }
        self.add(call_record(model, purpose, usage, cost, attempts));
    }

    fn add(&mut self, call: LlmCall) {
        self.total += call.usage;
        if let Some(c) = call.cost_usd {
            *self.cost.get_or_insert(0.0) += c;
        }
        self.calls.push(call);
    }

    /// Every call's tokens, summed.
    pub fn total(&self) -> Usage {
        self.total
    }

    /// The summed cost of the calls with a price.
    pub fn cost(&self) -> Option<f64> {
        self.cost
    }

    /// The calls, in the order they were made.
    pub fn calls(&self) -> &[LlmCall] {
        &self.calls
    }

    pub(crate) fn into_calls(self) -> Vec<LlmCall> {
        self.calls
    }
}

fn call_record(
    model: &str,
    purpose: &str,
    usage: Usage,
    cost: Option<f64>,
    attempts: u32,
) -> LlmCall {
    LlmCall {
        model: model.to_string(),
        purpose: purpose.to_string(),
        usage,
        cost_usd: cost,
        attempts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_the_calls_and_cost_is_known_once_a_call_has_a_price() {
        let mut ledger = UsageLedger::default();
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            total_tokens: 15,
            ..Usage::default()
        };
        ledger.add(call_record("m", "conversation", usage, None, 1));
        assert_eq!(ledger.cost(), None);
        ledger.add(call_record("m", "conversation", usage, Some(0.5), 2));
        ledger.add(call_record("m", "conversation", usage, Some(0.25), 1));
        assert_eq!(ledger.total().prompt_tokens, 30);
        assert_eq!(ledger.total().total_tokens, 45);
        assert_eq!(ledger.cost(), Some(0.75));
        assert_eq!(ledger.calls().len(), 3);
        assert_eq!(ledger.calls()[1].attempts, 2);
    }
}
