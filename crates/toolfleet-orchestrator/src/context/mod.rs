//! Context, the second stage: from a chat job to the [`Invocation`] the
//! model's first call works on.
//!
//! The stage opens the invocation with its profile ([`open`]: the job's
//! profile among the configured ones, or its tenant's default — refused
//! when unknown or not its tenant's to use —, its first deployment with a
//! usable key, the orchestrator its `orchestrator` name resolves to — the one
//! fact every later step reads), then runs an ordered list of
//! [`ContextHandler`]s over it ([`ContextHandlers`]). The built-ins, in
//! order:
//!
//! 1. `invocation_context` — the [`InvocationContext`] every tool job
//!    carries in its headers, with the deadline, the trust of the
//!    deployment in use and the user only when its tenant is trusted to
//!    assert it; a data source its tenant may not use fails the job
//!    (`data_source_not_allowed`);
//! 2. `conversation` — the system prompt, then the job's messages;
//! 3. `permitted_tools` — the tools the invocation may use at all (the
//!    gates of [`gating`](crate::tools::gating): system, profile, selected
//!    and agent tools; purpose, `visibleIn`, provider confidence,
//!    liveness);
//! 4. `sink_route` — where the events also go ([`route_for`]: the job's
//!    sink, else its profile's; a refused one is `invalid_sink`, before
//!    any model call);
//! 5. `scoping` — the tools offered first ([`scope::choose`]): all of them,
//!    the most relevant, or what a planning call names;
//! 6. `started` — the `started` event (model, profile, offered tools), then
//!    the `scoping` event saying how they were chosen;
//! 7. `preemptive_rag` — the attachments and data source searched with the
//!    user's question ([`rag::prefetch`]); their passages join the
//!    conversation and their references are published.
//!
//! A deployment adds its own handler with
//! [`OrchestratorConfig::register_context_handler`](crate::OrchestratorConfig::register_context_handler)
//! (after the built-ins) or at a place among them
//! ([`ContextHandlers::insert_before`], [`ContextHandlers::insert_after`]).
//! A handler fails the job by returning a [`Failure`]; the frame then
//! publishes the `error` event.
//!
//! Resuming a parked invocation opens it again and runs only the first
//! three steps ([`reopen`]): the conversation and the offered tools come
//! from the parked record.

pub mod rag;
pub mod scope;
mod steps;

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use toolfleet_protocol::{ChatEventBody, ChatJob, InvocationContext};

use crate::invocation::{CancelCheck, Citations};
use crate::tools::Scope;
use crate::tools::gating::Permitted;
use crate::{Events, Failure, Fleet, Invocation, UsageLedger};

pub use steps::{
    DEFAULT_SYSTEM_PROMPT, check_data_sources, conversation, invocation_context, resolve_profile,
    route_for,
};

/// What a context handler works with besides the invocation.
pub struct Context<'a> {
    pub fleet: &'a Fleet,
    /// The invocation's events (`started` is out once the `started`
    /// handler ran).
    pub events: &'a Events,
    /// The `scoping` event the `scoping` handler decided, for `started` to
    /// publish after its own.
    scoping: Option<ChatEventBody>,
}

/// One step of the context stage: shapes the invocation before the
/// model's first call (adds messages, narrows tools, publishes events).
pub trait ContextHandler: Send + Sync + 'static {
    /// Its name in the list (and in logs); unique among the handlers.
    fn name(&self) -> &str;

    /// Runs the step on `inv`. A [`Failure`] ends the invocation with an
    /// `error` event.
    fn handle<'a>(
        &'a self,
        inv: &'a mut Invocation,
        cx: &'a mut Context<'_>,
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

/// The context stage's handlers, in the order they run.
#[derive(Clone)]
pub struct ContextHandlers(Vec<Arc<dyn ContextHandler>>);

impl Default for ContextHandlers {
    /// The built-ins (see the module docs).
    fn default() -> Self {
        Self(vec![
            Arc::new(builtin::INVOCATION_CONTEXT),
            Arc::new(builtin::CONVERSATION),
            Arc::new(builtin::PERMITTED_TOOLS),
            Arc::new(builtin::SINK_ROUTE),
            Arc::new(builtin::Scoping),
            Arc::new(builtin::STARTED),
            Arc::new(builtin::PreemptiveRag),
        ])
    }
}

impl std::fmt::Debug for ContextHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl ContextHandlers {
    /// The handlers' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(|h| h.name()).collect()
    }

    /// Adds `handler` at the end (after the built-ins: the references of
    /// preemptive retrieval are out, the model not called yet).
    pub fn push(&mut self, handler: impl ContextHandler) -> &mut Self {
        self.0.push(Arc::new(handler));
        self
    }

    /// Adds `handler` right before the one named `name`.
    ///
    /// # Errors
    ///
    /// When no handler has that name (the names are listed).
    pub fn insert_before(
        &mut self,
        name: &str,
        handler: impl ContextHandler,
    ) -> Result<&mut Self, String> {
        let at = self.position(name)?;
        self.0.insert(at, Arc::new(handler));
        Ok(self)
    }

    /// Adds `handler` right after the one named `name`.
    ///
    /// # Errors
    ///
    /// When no handler has that name (the names are listed).
    pub fn insert_after(
        &mut self,
        name: &str,
        handler: impl ContextHandler,
    ) -> Result<&mut Self, String> {
        let at = self.position(name)?;
        self.0.insert(at + 1, Arc::new(handler));
        Ok(self)
    }

    fn position(&self, name: &str) -> Result<usize, String> {
        self.0.iter().position(|h| h.name() == name).ok_or_else(|| {
            format!(
                "no context handler is named {name:?} (there are: {})",
                self.names().join(", ")
            )
        })
    }

    /// Runs every handler on `inv`, in order; the first failure ends the
    /// stage.
    pub async fn run(
        &self,
        inv: &mut Invocation,
        fleet: &Fleet,
        events: &Events,
    ) -> Result<(), Failure> {
        let mut cx = Context {
            fleet,
            events,
            scoping: None,
        };
        for handler in &self.0 {
            handler.handle(inv, &mut cx).await?;
        }
        Ok(())
    }
}

/// Opens the invocation of `job`: its profile resolved among the
/// registered `orchestrators`; the rest is empty until the handlers fill
/// it in.
pub fn open(
    fleet: &Fleet,
    job: ChatJob,
    deadline_ms: u64,
    agent_depth: u32,
    orchestrators: &[&str],
) -> Result<Invocation, Failure> {
    let profile = resolve_profile(fleet, &job, orchestrators)?;
    let scope = Scope::new(
        fleet.tool_snapshot(),
        Permitted::default(),
        profile.profile.scoping,
    );
    Ok(Invocation {
        ctx: InvocationContext {
            invocation_id: job.invocation_id.clone(),
            deadline_ms: Some(deadline_ms),
            ..InvocationContext::default()
        },
        job,
        profile,
        messages: Vec::new(),
        tools: Vec::new(),
        scope,
        agent_depth,
        deadline_ms,
        usage: UsageLedger::default(),
        citations: Citations::default(),
        cancel_check: CancelCheck::default(),
        thread: None,
    })
}

/// Opens the invocation of a parked `job` again, with its invocation
/// context, conversation and permitted tools (what resuming starts from;
/// the parked record then restores the conversation and offered tools).
pub fn reopen(
    fleet: &Fleet,
    job: ChatJob,
    deadline_ms: u64,
    agent_depth: u32,
    orchestrators: &[&str],
) -> Result<Invocation, Failure> {
    let mut inv = open(fleet, job, deadline_ms, agent_depth, orchestrators)?;
    builtin::first_steps(&mut inv, fleet)?;
    Ok(inv)
}

/// The built-in handlers.
mod builtin {
    use super::*;

    /// Runs what `invocation_context`, `conversation` and
    /// `permitted_tools` do.
    pub(super) fn first_steps(inv: &mut Invocation, fleet: &Fleet) -> Result<(), Failure> {
        open_context(inv, fleet)?;
        inv.messages = conversation(&inv.job, &inv.profile);
        inv.scope = fleet.permitted_tools(&inv.job, &inv.profile, &inv.ctx, inv.agent_depth)?;
        Ok(())
    }

    /// What `invocation_context` does.
    fn open_context(inv: &mut Invocation, fleet: &Fleet) -> Result<(), Failure> {
        let trust_user = fleet.config().profiles.trusts_user(inv.job.tenant());
        inv.ctx = invocation_context(&inv.job, &inv.profile, inv.deadline_ms, trust_user);
        // The workers that call models hold the tenant to its limits too.
        inv.ctx.tenant_limits = crate::quota::carried(fleet, inv.job.tenant());
        check_data_sources(fleet, &inv.ctx)
    }

    /// A built-in step that waits for nothing.
    pub(super) struct Now {
        name: &'static str,
        step: fn(&mut Invocation, &mut Context<'_>) -> Result<(), Failure>,
    }

    impl ContextHandler for Now {
        fn name(&self) -> &str {
            self.name
        }

        fn handle<'a>(
            &'a self,
            inv: &'a mut Invocation,
            cx: &'a mut Context<'_>,
        ) -> BoxFuture<'a, Result<(), Failure>> {
            std::future::ready((self.step)(inv, cx)).boxed()
        }
    }

    pub(super) const INVOCATION_CONTEXT: Now = Now {
        name: "invocation_context",
        step: |inv, cx| open_context(inv, cx.fleet),
    };

    pub(super) const CONVERSATION: Now = Now {
        name: "conversation",
        step: |inv, _| {
            inv.messages = conversation(&inv.job, &inv.profile);
            // A thread's earlier turns go before the job's new messages.
            if let Some(thread) = &inv.thread {
                thread.prepend(&mut inv.messages);
            }
            Ok(())
        },
    };

    pub(super) const PERMITTED_TOOLS: Now = Now {
        name: "permitted_tools",
        step: |inv, cx| {
            inv.scope =
                cx.fleet
                    .permitted_tools(&inv.job, &inv.profile, &inv.ctx, inv.agent_depth)?;
            Ok(())
        },
    };

    pub(super) const SINK_ROUTE: Now = Now {
        name: "sink_route",
        step: |inv, cx| {
            if let Some(route) = route_for(cx.fleet, inv)? {
                cx.events.route(route);
            }
            Ok(())
        },
    };

    pub(super) const STARTED: Now = Now {
        name: "started",
        step: |inv, cx| {
            cx.events.send(ChatEventBody::Started {
                model: inv.model().to_string(),
                profile: Some(inv.profile.name.clone()),
                tools: inv.tool_ids(),
                thread_id: inv.job.thread_id.clone(),
            });
            // Nothing to say when every permitted tool is offered and
            // nothing was left out: `started` lists them.
            match cx.scoping.take() {
                Some(ChatEventBody::Scoping {
                    ref decision,
                    note: None,
                    ..
                }) if decision == "all" => {}
                Some(scoping) => cx.events.send(scoping),
                None => {}
            }
            Ok(())
        },
    };

    pub(super) struct Scoping;

    impl ContextHandler for Scoping {
        fn name(&self) -> &str {
            "scoping"
        }

        fn handle<'a>(
            &'a self,
            inv: &'a mut Invocation,
            cx: &'a mut Context<'_>,
        ) -> BoxFuture<'a, Result<(), Failure>> {
            async move {
                cx.scoping = Some(scope::choose(cx.fleet, inv).await);
                Ok(())
            }
            .boxed()
        }
    }

    pub(super) struct PreemptiveRag;

    impl ContextHandler for PreemptiveRag {
        fn name(&self) -> &str {
            "preemptive_rag"
        }

        fn handle<'a>(
            &'a self,
            inv: &'a mut Invocation,
            cx: &'a mut Context<'_>,
        ) -> BoxFuture<'a, Result<(), Failure>> {
            async move { rag::prefetch(cx.fleet, inv, cx.events).await.map(drop) }.boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Named(&'static str);

    impl ContextHandler for Named {
        fn name(&self) -> &str {
            self.0
        }

        fn handle<'a>(
            &'a self,
            _: &'a mut Invocation,
            _: &'a mut Context<'_>,
        ) -> BoxFuture<'a, Result<(), Failure>> {
            std::future::ready(Ok(())).boxed()
        }
    }

    #[test]
    fn the_built_ins_run_in_order_and_a_handler_goes_where_it_is_put() {
        let mut handlers = ContextHandlers::default();
        assert_eq!(
            handlers.names(),
            [
                "invocation_context",
                "conversation",
                "permitted_tools",
                "sink_route",
                "scoping",
                "started",
                "preemptive_rag"
            ]
        );
        handlers.push(Named("last"));
        handlers
            .insert_before("scoping", Named("tenant_check"))
            .unwrap();
        handlers
            .insert_after("conversation", Named("note"))
            .unwrap();
        assert_eq!(
            handlers.names(),
            [
                "invocation_context",
                "conversation",
                "note",
                "permitted_tools",
                "sink_route",
                "tenant_check",
                "scoping",
                "started",
                "preemptive_rag",
                "last"
            ]
        );
        let e = handlers.insert_after("nope", Named("x")).unwrap_err();
        assert!(
            e.contains("\"nope\"") && e.contains("preemptive_rag"),
            "{e}"
        );
    }
}
