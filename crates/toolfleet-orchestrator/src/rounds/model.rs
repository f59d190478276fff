//! [`Fleet::call_model`]: one model call with its deltas, metrics, usage
//! and fallback across the profile's deployments.

use std::time::Instant;

use toolfleet_llm::{ChatRequest, Completion};
use toolfleet_protocol::ChatEventBody;

use super::PURPOSE_CONVERSATION;
use crate::failure::ChatErrorCode;
use crate::usage::ModelCall;
use crate::{Events, Failure, Fleet, Invocation};

impl Fleet {
    /// One model call for `inv`: text deltas are sent as `delta` events as
    /// they stream; the request, retry and duration metrics and the usage
    /// ledger (with its token and cost metrics) are updated. When the
    /// profile's deployment fails before any text has streamed (an error
    /// its retries did not cure: connection, timeout, 429, 5xx), the call
    /// goes to the profile's next deployment (`request.model` becomes its
    /// model, a `fallback` event says so); the invocation stays on it. A
    /// failed call is a [`Failure`] with code `llm_<kind>`. Each attempt is
    /// admitted under the tenant's limits first ([`crate::quota`]): a
    /// refusal is the [`Failure`] (`rate_limited`, `budget_exhausted`,
    /// `run_limit_exceeded`), and what the call used is counted after it.
    pub async fn call_model(
        &self,
        inv: &mut Invocation,
        request: &mut ChatRequest,
        events: &Events,
    ) -> Result<Completion, Failure> {
        loop {
            for warning in self.admit_model_call(inv).await? {
                events.send(warning);
            }
            let llm = self.llm_for(&inv.profile)?;
            let mut streamed = false;
            let result = self
                .call_once(&llm, inv, request, events, &mut streamed)
                .await;
            match result {
                Err(e) if !streamed && e.is_retryable() => {
                    let Some(next) = inv.profile.next_deployment(e.code()) else {
                        return Err(Failure::new(ChatErrorCode::llm(e.code()), e.to_string()));
                    };
                    tracing::warn!(
                        invocation_id = %inv.job.invocation_id,
                        from = %inv.profile.deployment_name,
                        to = %next.deployment_name,
                        code = e.code(),
                        "deployment failed before any output; falling back"
                    );
                    self.metrics
                        .llm_fallbacks
                        .with_label_values(&[
                            inv.profile.deployment_name.as_str(),
                            next.deployment_name.as_str(),
                        ])
                        .inc();
                    events.send(ChatEventBody::Fallback {
                        from: inv.profile.deployment_name.clone(),
                        from_model: inv.profile.model().to_string(),
                        to: next.deployment_name.clone(),
                        to_model: next.model().to_string(),
                        code: e.code().to_string(),
                    });
                    inv.use_deployment(next);
                    request.model = inv.profile.model().to_string();
                }
                Err(e) => return Err(Failure::new(ChatErrorCode::llm(e.code()), e.to_string())),
                Ok(completion) => {
                    for warning in self.count_usage(inv).await {
                        events.send(warning);
                    }
                    return Ok(completion);
                }
            }
        }
    }

    /// One attempt of [`call_model`](Self::call_model) on the profile's
    /// current deployment; `streamed` is set once a delta went out.
    async fn call_once(
        &self,
        llm: &toolfleet_llm::LlmClient,
        inv: &mut Invocation,
        request: &ChatRequest,
        events: &Events,
        streamed: &mut bool,
    ) -> Result<Completion, toolfleet_llm::LlmError> {
        let model = request.model.as_str();
        let started = Instant::now();
        let completion = llm
            .stream_chat(request, |text| {
                *streamed = true;
                events.send(ChatEventBody::Delta {
                    text: text.to_string(),
                })
            })
            .await;
        let m = &self.metrics;
        m.llm_request_duration
            .with_label_values(&[model])
            .observe(started.elapsed().as_secs_f64());
        let attempts = match &completion {
            Ok(c) => c.attempts,
            Err(e) => e.attempts(),
        };
        if attempts > 1 {
            m.llm_retries
                .with_label_values(&[model])
                .inc_by(u64::from(attempts - 1));
        }
        let completion = match completion {
            Ok(c) => c,
            Err(e) => {
                m.llm_requests.with_label_values(&[model, e.code()]).inc();
                return Err(e);
            }
        };
        m.llm_requests.with_label_values(&[model, "ok"]).inc();
        if inv.profile.deployment.has_fleet_limits() {
            m.provider_queued
                .with_label_values(&[inv.profile.deployment_name.as_str()])
                .observe(completion.queued.as_secs_f64());
        }
        if let Some(ttft) = completion.time_to_first_token {
            m.llm_time_to_first_token
                .with_label_values(&[model])
                .observe(ttft.as_secs_f64());
        }
        let usage = completion.usage.unwrap_or_default();
        inv.usage.record(
            m,
            ModelCall {
                model,
                purpose: PURPOSE_CONVERSATION,
                usage,
                cost: self.config.profiles.prices.cost(model, &usage),
                attempts,
            },
        );
        Ok(completion)
    }
}
