//! [`Fleet::call_model`]: one model call with its deltas, metrics, usage
//! and fallback across the profile's deployments; and what keeps the
//! provider's prompt cache useful: the [`prompt_cache_key`] a
//! conversation's requests carry, and the count of turns whose prompt
//! prefix changed ([`prefix_hash`]).
//!
//! A provider's prompt cache (OpenAI's, vLLM's prefix cache) serves the
//! longest beginning a prompt shares with a recent one. The stable
//! beginning of a conversation's requests is the profile's system prompt,
//! then its tools (in the order [`Invocation::tool_specs`] keeps: the
//! first request's sorted by name, later additions after them), then the
//! history. The history mostly grows, turn by turn; a compaction replaces
//! its older part with a summary, and the request after it misses the
//! cache from there on. Within an invocation the tools change only when a
//! `search_tools` call adds some (and, across a park, when an offered
//! tool's workers all left before the resume); between invocations, when
//! scoping picks others or the catalog changed. A turn whose tools
//! changed pays again for the prompt from the first new tool on, and
//! `toolfleet_prompt_prefix_changes_total{profile}` counts it.

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
    /// A call whose prompt prefix differs from the invocation's previous
    /// call's is counted in `toolfleet_prompt_prefix_changes_total`.
    pub async fn call_model(
        &self,
        inv: &mut Invocation,
        request: &mut ChatRequest,
        events: &Events,
    ) -> Result<Completion, Failure> {
        self.note_prefix(inv, request);
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

    /// Counts the call in `toolfleet_prompt_prefix_changes_total` when its
    /// prompt prefix differs from the invocation's previous call's (kept
    /// in the usage ledger, so it survives a park). Once per turn: a
    /// fallback to the next deployment sends the same prefix.
    fn note_prefix(&self, inv: &mut Invocation, request: &ChatRequest) {
        if inv.usage.prefix_changed(prefix_hash(request)) {
            self.metrics
                .prompt_prefix_changes
                .with_label_values(&[inv.profile.name.as_str()])
                .inc();
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

/// The `prompt_cache_key` of a conversation's model calls: `tf-` and 16
/// hex digits of the SHA-256 of the fleet's subject prefix, the tenant
/// and the profile. One key per tenant and profile, so a tenant's
/// requests are routed together, and never under another tenant's key —
/// routing only: the provider's cache is its organization's, found by
/// prefix whatever the key, so tenants whose caches must be apart need
/// separate provider projects. Hashed, because a tenant's name may be a
/// customer's and the key goes to the provider (whose logs and
/// dashboards show it); but unsalted, over guessable inputs, so whoever
/// sees a key can confirm a guessed tenant name. The same in every
/// orchestrator and release, so the whole fleet's calls share it.
/// Sixty-four bits keep two tenants apart for any number of tenants a
/// fleet has.
pub fn prompt_cache_key(prefix: &str, tenant: &str, profile: &str) -> String {
    let mut input = Vec::with_capacity(prefix.len() + tenant.len() + profile.len() + 2);
    for (i, part) in [prefix, tenant, profile].into_iter().enumerate() {
        if i > 0 {
            // A separator no name holds: (`ab`, `c`) and (`a`, `bc`)
            // must not meet.
            input.push(0);
        }
        input.extend_from_slice(part.as_bytes());
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, &input);
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("tf-{hex}")
}

/// A hash of what a provider's prompt cache can share between two calls
/// of one conversation: the first system message (the profile's system
/// prompt; a Responses request's `instructions`) and the tools in the
/// order the wire sends them, not what follows them (a job's own system
/// messages, the history).
pub fn prefix_hash(request: &ChatRequest) -> u64 {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut part = |bytes: &[u8]| {
        // Each part with its length, so parts cannot run into each other.
        context.update(&(bytes.len() as u64).to_le_bytes());
        context.update(bytes);
    };
    match request.messages.first() {
        Some(toolfleet_llm::Message::System { content }) => part(content.as_bytes()),
        _ => part(b""),
    }
    for tool in &request.tools {
        part(tool.to_chat_completions().to_string().as_bytes());
    }
    let digest = context.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;
    use toolfleet_llm::{Message, ToolSpec};

    use super::*;

    fn tool(name: &str) -> Arc<ToolSpec> {
        Arc::new(ToolSpec {
            name: name.to_owned(),
            description: format!("the {name} tool"),
            parameters: json!({"type": "object"}),
            strict: false,
        })
    }

    fn request(system: &str, tools: &[&str], history: &[&str]) -> ChatRequest {
        let mut messages = vec![Message::System {
            content: system.to_owned(),
        }];
        messages.extend(history.iter().map(|h| Message::User {
            content: (*h).to_owned(),
        }));
        ChatRequest {
            model: "m".into(),
            messages,
            tools: tools.iter().map(|t| tool(t)).collect(),
            tool_choice: None,
            parallel_tool_calls: true,
            temperature: None,
            max_tokens: None,
            service_tier: None,
            prompt_cache_key: None,
        }
    }

    #[test]
    fn the_prefix_is_the_system_prompt_and_the_tools_in_order_not_what_follows() {
        let first = prefix_hash(&request("Be brief.", &["a", "b"], &["hi"]));
        assert_eq!(
            first,
            prefix_hash(&request(
                "Be brief.",
                &["a", "b"],
                &["hi", "more", "and more"]
            )),
            "a longer history keeps the prefix"
        );
        let mut own_system = request("Be brief.", &["a", "b"], &["hi"]);
        own_system.messages.insert(
            1,
            Message::System {
                content: "The job's own instructions.".into(),
            },
        );
        assert_eq!(
            first,
            prefix_hash(&own_system),
            "a job's own system message comes after the prefix"
        );
        assert_ne!(
            first,
            prefix_hash(&request("Be brief.", &["b", "a"], &["hi"])),
            "the order the tools are sent in is part of the prompt"
        );
        assert_ne!(
            first,
            prefix_hash(&request("Be brief.", &["a", "b", "c"], &["hi"]))
        );
        assert_ne!(first, prefix_hash(&request("Be brief.", &["a"], &["hi"])));
        assert_ne!(
            first,
            prefix_hash(&request("Be long.", &["a", "b"], &["hi"]))
        );
        // Each part is framed by its length: a system prompt that ends
        // with a tool's very JSON is not that prompt and that tool.
        let glued = format!("x{}", tool("a").to_chat_completions());
        assert_ne!(
            prefix_hash(&request(&glued, &[], &[])),
            prefix_hash(&request("x", &["a"], &[]))
        );
    }

    #[test]
    fn the_cache_key_is_opaque_stable_and_per_tenant_and_profile() {
        let key = prompt_cache_key("toolfleet", "acme", "default");
        assert_eq!(key, prompt_cache_key("toolfleet", "acme", "default"));
        assert_eq!(key.len(), 3 + 16);
        assert!(key.starts_with("tf-") && key[3..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!key.contains("acme") && !key.contains("default"));
        for other in [
            prompt_cache_key("toolfleet", "globex", "default"),
            prompt_cache_key("toolfleet", "acme", "support"),
            prompt_cache_key("staging", "acme", "default"),
            prompt_cache_key("toolfleet", "acme\0default", ""),
        ] {
            assert_ne!(key, other);
        }
        // A fixed value: the key must not change between releases (every
        // orchestrator of a fleet sends the same), so a new hash is a
        // deliberate change, made here.
        assert_eq!(
            prompt_cache_key("toolfleet", "default", "default"),
            "tf-3964b1226ec6a290"
        );
    }
}
