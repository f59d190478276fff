//! [`UsageLedger`]: the tokens and cost of one invocation's model calls,
//! recorded in the `completed` event and in the token and cost metrics at
//! once, so the two never disagree.

use toolfleet_llm::Usage;
use toolfleet_protocol::LlmCall;

use crate::metrics::OrchestratorMetrics;

/// The `purpose` of model calls made by tools.
pub const PURPOSE_TOOL: &str = "tool";

/// Token usage and cost of one invocation, per model call.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct UsageLedger {
    total: Usage,
    /// `None` until a call with a known price is recorded.
    cost: Option<f64>,
    calls: Vec<LlmCall>,
    /// Tokens and millionths of a USD already added to the tenant's
    /// fleet-wide counts ([`crate::quota`]).
    #[serde(default)]
    counted: (u64, u64),
    /// The limits a `limit_warning` was sent for in this invocation.
    #[serde(default)]
    warned: Vec<String>,
    /// The prompt prefix of the last conversation call
    /// ([`crate::rounds::prefix_hash`]), kept with the ledger so a resumed
    /// invocation compares with the call before it parked.
    #[serde(default)]
    prefix: Option<u64>,
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

    /// Adds a model call a tool reported with its result (purpose `tool`):
    /// its cost as reported, else from `prices`. The model's name comes
    /// from a worker, so only a short, plain one becomes a metric label
    /// (others count as `other`). Its worker has already added it to the
    /// tenant's fleet-wide counts (as reported: tokens, and the cost when
    /// it reported one), so it is marked counted here.
    pub fn record_tool(
        &mut self,
        metrics: &OrchestratorMetrics,
        prices: &toolfleet_llm::prices::PriceTable,
        mut call: LlmCall,
    ) {
        call.purpose = PURPOSE_TOOL.to_owned();
        // What the worker added to the tenant's counts: the tokens, and
        // the cost only when the tool reported one.
        let reported_cost = call.cost_usd.is_some();
        if call.cost_usd.is_none() {
            call.cost_usd = prices.cost(&call.model, &call.usage);
        }
        let plain = call.model.len() <= 64
            && call
                .model
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b));
        let label = if plain { call.model.as_str() } else { "other" };
        for (kind, n) in [
            ("prompt", call.usage.prompt_tokens),
            ("completion", call.usage.completion_tokens),
            ("cached", call.usage.cached_tokens),
            ("reasoning", call.usage.reasoning_tokens),
        ] {
            metrics
                .llm_tokens
                .with_label_values(&[label, kind, PURPOSE_TOOL])
                .inc_by(n);
        }
        if let Some(c) = call.cost_usd.filter(|c| c.is_finite() && *c >= 0.0) {
            metrics
                .llm_cost
                .with_label_values(&[label, PURPOSE_TOOL])
                .inc_by(c);
        }
        let before = self.spent();
        self.add(call);
        let after = self.spent();
        self.counted.0 += after.0.saturating_sub(before.0);
        if reported_cost {
            self.counted.1 += after.1.saturating_sub(before.1);
        }
    }

    /// The summed cost of the calls with a price.
    pub fn cost(&self) -> Option<f64> {
        self.cost
    }

    /// The calls, in the order they were made.
    pub fn calls(&self) -> &[LlmCall] {
        &self.calls
    }

    /// Tokens (prompt and completion) and millionths of a USD of every
    /// call so far.
    pub fn spent(&self) -> (u64, u64) {
        let t = self.total;
        let tokens = t.total_tokens.max(t.prompt_tokens + t.completion_tokens);
        let micros = self
            .cost
            .and_then(toolfleet_config::Usd::from_usd)
            .map_or(0, toolfleet_config::Usd::micros);
        (tokens, micros)
    }

    /// What [`spent`](Self::spent) adds since the last
    /// [`counted`](Self::counted).
    pub(crate) fn uncounted(&self) -> (u64, u64) {
        let (tokens, micros) = self.spent();
        (
            tokens.saturating_sub(self.counted.0),
            micros.saturating_sub(self.counted.1),
        )
    }

    /// Marks `spent` as added to the tenant's counts.
    pub(crate) fn counted(&mut self, spent: (u64, u64)) {
        self.counted = (self.counted.0.max(spent.0), self.counted.1.max(spent.1));
    }

    /// Notes the prompt prefix of a conversation call; `true` when an
    /// earlier call of the invocation had another one (the provider's
    /// prompt cache could not serve this call's beginning).
    pub(crate) fn prefix_changed(&mut self, hash: u64) -> bool {
        self.prefix
            .replace(hash)
            .is_some_and(|before| before != hash)
    }

    /// `true` the first time it is asked for `limit` in this invocation.
    pub(crate) fn warn_once(&mut self, limit: &str) -> bool {
        if self.warned.iter().any(|w| w == limit) {
            return false;
        }
        self.warned.push(limit.to_owned());
        true
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

    #[test]
    fn a_prefix_change_is_one_that_differs_from_the_call_before_even_after_a_park() {
        let mut ledger = UsageLedger::default();
        assert!(!ledger.prefix_changed(7), "the first call changes nothing");
        assert!(!ledger.prefix_changed(7));
        assert!(ledger.prefix_changed(8));
        let parked = serde_json::to_value(&ledger).expect("serialise");
        let mut resumed: UsageLedger = serde_json::from_value(parked).expect("read back");
        assert!(!resumed.prefix_changed(8));
        assert!(resumed.prefix_changed(7));
        // A ledger parked before the field existed reads as no call yet.
        let old: UsageLedger = serde_json::from_value(serde_json::json!({
            "total": Usage::default(), "cost": null, "calls": []
        }))
        .expect("an older ledger");
        assert_eq!(old.prefix, None);
    }
}
