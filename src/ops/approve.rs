//! `toolfleet approve`: a person's decision on a tool call that waits for
//! approval, sent to the orchestrators and their answer printed.

use std::time::Duration;

use clap::Args;
use toolfleet_protocol::approval::ApprovalDecision;
use toolfleet_service::args::NatsArgs;

#[derive(Args, Debug)]
pub struct ApproveArgs {
    /// The invocation id.
    invocation_id: String,
    /// The held call's id.
    call_id: String,
    /// Deny the call; the model reads the reason.
    #[arg(long, value_name = "REASON")]
    deny: Option<String>,
    /// Why it is approved (recorded in the `approval_resolved` event).
    #[arg(long, conflicts_with = "deny")]
    reason: Option<String>,
    /// Who decides, as recorded in the event and the log.
    #[arg(long, env = "TOOLFLEET_APPROVER")]
    approver: Option<String>,
    /// The invocation's tenant.
    #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
    tenant: String,
    /// Seconds to wait for an orchestrator's answer.
    #[arg(long, default_value_t = 5)]
    wait: u64,
    #[command(flatten)]
    nats: NatsArgs,
}

/// `toolfleet approve`: the decision of the flags, sent.
pub async fn run(args: ApproveArgs) -> anyhow::Result<i32> {
    let approval = toolfleet_protocol::Approval {
        call_id: args.call_id,
        decision: if args.deny.is_some() {
            ApprovalDecision::Deny
        } else {
            ApprovalDecision::Approve
        },
        reason: args.deny.or(args.reason),
        approver: args.approver,
    };
    approve(
        &args.invocation_id,
        &approval,
        &args.tenant,
        Duration::from_secs(args.wait),
        &args.nats,
    )
    .await
}

/// Sends `approval` for a held call of `invocation_id` and prints the
/// orchestrator's answer: exit 0 when recorded, 1 when refused or nobody
/// answers, 64 for a malformed tenant, id or decision.
async fn approve(
    invocation_id: &str,
    approval: &toolfleet_protocol::Approval,
    tenant: &str,
    wait: Duration,
    nats: &NatsArgs,
) -> anyhow::Result<i32> {
    if !crate::common::tenant_ok("toolfleet approve", tenant)
        || !crate::common::invocation_ok("toolfleet approve", invocation_id)
    {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let body = serde_json::to_vec(approval)?;
    // Checked here as the orchestrator will check it: a clear error
    // without a round trip.
    if let Err(e) = toolfleet_protocol::Approval::decode(&body) {
        eprintln!("toolfleet approve: {e}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-approve").await?;
    let subject = subjects.chat_approve(tenant, invocation_id);
    let reply = match tokio::time::timeout(wait, client.request(subject, body.into())).await {
        Err(_) => {
            eprintln!(
                "toolfleet approve: no answer within {} s (is an orchestrator running?); the decision may or may not be recorded: send it again (a repeat of a recorded one is refused as already_decided)",
                wait.as_secs()
            );
            return Ok(1);
        }
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            eprintln!(
                "toolfleet approve: no orchestrator is running (or this identity may not approve for tenant {tenant}); nothing was recorded"
            );
            return Ok(1);
        }
        Ok(Err(e)) => anyhow::bail!("approval request: {e}"),
        Ok(Ok(msg)) => msg,
    };
    let reply: toolfleet_protocol::approval::ApprovalReply = serde_json::from_slice(&reply.payload)
        .map_err(|e| anyhow::anyhow!("the orchestrator's answer cannot be read: {e}"))?;
    if reply.ok {
        let what = match approval.decision {
            ApprovalDecision::Approve => "approved",
            ApprovalDecision::Deny => "denied",
        };
        println!(
            "{} {what}; {invocation_id} resumes once every held call of its turn is decided",
            approval.call_id
        );
        Ok(0)
    } else {
        eprintln!(
            "toolfleet approve: refused ({}): {}",
            reply.code.as_deref().unwrap_or("error"),
            reply.error.as_deref().unwrap_or("")
        );
        Ok(1)
    }
}
