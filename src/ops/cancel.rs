//! `toolfleet cancel`: stop a running invocation (or, with `--call`, one
//! of its tool calls) and wait for the fleet to confirm it.

use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use toolfleet_protocol::{ChatEvent, ChatEventBody};
use toolfleet_service::args::NatsArgs;

#[derive(Args, Debug)]
pub struct CancelArgs {
    /// The invocation id.
    invocation_id: String,
    /// Only this tool call of the invocation.
    #[arg(long = "call", value_name = "CALL_ID")]
    call_id: Option<String>,
    /// The invocation's tenant.
    #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
    tenant: String,
    /// Seconds to wait for the confirmation.
    #[arg(long, default_value_t = 5)]
    wait: u64,
    #[command(flatten)]
    nats: NatsArgs,
}

/// `toolfleet cancel`: publishes the cancel and waits for the fleet's
/// confirmation. Exit 0 once confirmed; 1 when the invocation is unknown,
/// already finished, or the confirmation does not come in time; 64 for a
/// malformed tenant or id.
pub async fn run(args: CancelArgs) -> anyhow::Result<i32> {
    let (invocation_id, tenant) = (args.invocation_id.as_str(), args.tenant.as_str());
    let call_id = args.call_id.as_deref();
    let wait = Duration::from_secs(args.wait);
    if !crate::common::tenant_ok("toolfleet cancel", tenant)
        || !crate::common::invocation_ok("toolfleet cancel", invocation_id)
    {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if let Some(call) = call_id
        && !toolfleet_protocol::valid_invocation_id(call)
    {
        eprintln!("toolfleet cancel: --call {call:?} is not a call id");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects = args.nats.subjects()?;
    let client = args.nats.connect("toolfleet-cancel").await?;
    // Subscribed first: a terminal event between the reading and the
    // subscription is not missed.
    let mut events = client
        .subscribe(subjects.chat_events(tenant, invocation_id))
        .await?;
    client.flush().await?;
    let last =
        toolfleet_protocol::client::last_event(&client, &subjects, tenant, invocation_id).await?;
    match last.as_ref().map(terminal) {
        Some(Some(how)) => {
            println!("{invocation_id} already finished: {how}; nothing to cancel");
            return Ok(1);
        }
        None if call_id.is_some() => {
            // No run yet (or none at all): there is no call to stop, and the
            // invocation is not ours to end.
            println!(
                "{invocation_id} of tenant {tenant} has no event: unknown, or not started; \
                 nothing cancelled"
            );
            return Ok(1);
        }
        None => {
            // Maybe still queued: the cancel is remembered for it.
            toolfleet_protocol::client::cancel(&client, &subjects, tenant, invocation_id).await?;
            println!(
                "{invocation_id} of tenant {tenant} has no event: unknown, or still queued \
                 (the cancel is sent and remembered, so a queued job ends cancelled when it starts)"
            );
            return Ok(1);
        }
        Some(None) => {}
    }
    if let Some(call_id) = call_id {
        toolfleet_protocol::client::cancel_call(&client, &subjects, tenant, invocation_id, call_id)
            .await?;
    } else {
        toolfleet_protocol::client::cancel(&client, &subjects, tenant, invocation_id).await?;
    }
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, events.next()).await {
        let Ok(event) = toolfleet_protocol::Envelope::ChatEvent.decode::<ChatEvent>(&msg.payload)
        else {
            continue;
        };
        if let Some(code) = outcome(&event, invocation_id, call_id) {
            return Ok(code);
        }
    }
    match call_id {
        Some(call) => println!(
            "cancel of call {call} of {invocation_id} sent; no confirmation within {} s \
             (the call may have finished before, or be an agent tool's, which stops \
             only with its invocation)",
            wait.as_secs()
        ),
        None => println!(
            "cancel of {invocation_id} sent; no confirmation within {} s",
            wait.as_secs()
        ),
    }
    Ok(1)
}

/// How an invocation ended, when `e` is its terminal event.
fn terminal(e: &ChatEvent) -> Option<String> {
    match &e.body {
        ChatEventBody::Completed { .. } => Some("completed".to_owned()),
        ChatEventBody::Error { code, .. } => Some(format!("error ({code})")),
        _ => None,
    }
}

/// What `event`, seen after the cancel was sent, says of it: printed, with
/// the exit code, once it settles the matter (the call's result, or the
/// invocation's end); `None` to wait on.
fn outcome(event: &ChatEvent, invocation_id: &str, call_id: Option<&str>) -> Option<i32> {
    if let (
        Some(call_id),
        ChatEventBody::ToolResult {
            call_id: done,
            error_code,
            status,
            ..
        },
    ) = (call_id, &event.body)
        && done == call_id
    {
        if error_code.as_deref() == Some("call_cancelled") {
            println!("call {call_id} of {invocation_id} cancelled; the invocation goes on");
            return Some(0);
        }
        println!(
            "call {call_id} of {invocation_id} finished before the cancel took effect: {}",
            status.as_str()
        );
        return Some(1);
    }
    match terminal(event) {
        Some(how) if call_id.is_some() => {
            println!("{invocation_id} ended ({how}) before the call's cancel was confirmed");
            Some(1)
        }
        Some(how) if how == "error (cancelled)" => {
            println!("{invocation_id} cancelled");
            Some(0)
        }
        Some(how) => {
            println!("{invocation_id} finished before the cancel took effect: {how}");
            Some(1)
        }
        None => None,
    }
}
