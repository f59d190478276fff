//! Human approval of tool calls: what a person sends
//! ([`Approval`], on [`Subjects::chat_approve`](crate::Subjects::chat_approve)),
//! what they are answered ([`ApprovalReply`]), and the decision record the
//! orchestrators keep among themselves ([`Decision`], on the decisions
//! stream).
//!
//! A call that needs approval parks its invocation: the orchestrator keeps
//! the conversation in the parked bucket, acks the chat job and publishes
//! `approval_requested`. Nothing waits in memory; any orchestrator copy
//! resumes the invocation once every held call of the turn is decided.

use serde::{Deserialize, Serialize};

use crate::ProtocolError;

/// The largest approval body accepted, in bytes.
pub const MAX_APPROVAL_BYTES: usize = 16 * 1024;
/// The longest `reason` or `approver`, in characters.
pub const MAX_REASON_CHARS: usize = 2_000;

/// A person's decision on one parked call (`schemas/approval.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Approval {
    /// The call, as named by its `approval_requested` event.
    pub call_id: String,
    /// Approve or deny.
    pub decision: ApprovalDecision,
    /// Why: a denial's reason is what the model reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who decided, as the sender says (recorded in the event and the
    /// log; NATS permissions on the approval subject decide who may send).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approver: Option<String>,
}

/// What a person decided about one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalDecision {
    /// Run the call as the model asked.
    Approve,
    /// Do not run it; the model reads the denial (and its reason) as the call's
    /// result.
    Deny,
}

impl Approval {
    /// Decodes and checks an approval body.
    ///
    /// # Errors
    ///
    /// [`ProtocolError`] when it is too large, not JSON, not an approval,
    /// or names a call id, reason or approver that is not acceptable.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        if bytes.len() > MAX_APPROVAL_BYTES {
            return Err(ProtocolError::TooLarge {
                size: bytes.len(),
                limit: MAX_APPROVAL_BYTES,
            });
        }
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ProtocolError::NotJson(e.to_string()))?;
        let approval: Approval =
            serde_json::from_value(value).map_err(|e| schema(e.to_string()))?;
        if !crate::valid_invocation_id(&approval.call_id) {
            return Err(schema(format!(
                "/callId: {:?} is not a call id ([A-Za-z0-9_-]{{1,128}})",
                approval.call_id
            )));
        }
        for (field, value) in [
            ("reason", &approval.reason),
            ("approver", &approval.approver),
        ] {
            if value
                .as_ref()
                .is_some_and(|v| v.chars().count() > MAX_REASON_CHARS)
            {
                return Err(schema(format!(
                    "/{field}: longer than {MAX_REASON_CHARS} characters"
                )));
            }
        }
        Ok(approval)
    }
}

fn schema(details: String) -> ProtocolError {
    ProtocolError::Schema {
        schema: "approval",
        details,
    }
}

/// How a parked call ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalOutcome {
    /// A person approved the call; it runs.
    Approved,
    /// A person denied the call; it does not run.
    Denied,
    /// Nobody decided within the profile's approval timeout.
    Timeout,
}

impl ApprovalOutcome {
    /// Every outcome, for registering metric labels up front.
    pub const ALL: [ApprovalOutcome; 3] = [Self::Approved, Self::Denied, Self::Timeout];

    /// The outcome's name on the wire and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approved => "approved",
            Self::Denied => "denied",
            Self::Timeout => "timeout",
        }
    }
}

/// The answer to an [`Approval`] request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApprovalReply {
    /// Whether the decision was recorded (the invocation resumes once every
    /// held call of its turn is decided).
    pub ok: bool,
    /// Why not: `malformed_approval`, `unknown_invocation`,
    /// `unknown_call`, `already_decided`, `unavailable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// A human-readable explanation of the refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ApprovalReply {
    /// The answer to an approval that was recorded.
    pub fn ok() -> Self {
        Self {
            ok: true,
            code: None,
            error: None,
        }
    }

    /// The answer to an approval that was not recorded, with its refusal `code`
    /// (see [`ApprovalReply::code`]) and an explanation.
    pub fn refused(code: &str, error: impl Into<String>) -> Self {
        Self {
            ok: false,
            code: Some(code.to_string()),
            error: Some(error.into()),
        }
    }
}

/// What happened to a parked invocation, as recorded on the decisions
/// stream by the orchestrators (never by clients).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Decision {
    /// The parked invocation.
    pub invocation_id: String,
    /// Which parking of the invocation it decides (an invocation may park
    /// more than once); a decision for an earlier one is ignored.
    pub park_id: String,
    /// What was decided.
    pub kind: DecisionKind,
    /// Unix ms when it was decided.
    pub at_ms: u64,
}

/// The kinds of decision on a parked invocation; each one counts once (see
/// [`Decision::msg_id`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DecisionKind {
    /// A person's approval or denial of one call.
    #[serde(rename_all = "camelCase")]
    Call {
        /// The call decided on.
        call_id: String,
        /// Approve or deny.
        decision: ApprovalDecision,
        /// Why, as the person said; the model reads a denial's reason.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// Who decided, as the sender says.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approver: Option<String>,
    },
    /// The approval timeout passed.
    Timeout,
    /// The invocation was cancelled while parked.
    Cancel,
}

impl Decision {
    /// The message id that makes the decision count once: one per call
    /// (the first of two different approvals of a call wins), one timeout
    /// and one cancel per parking.
    pub fn msg_id(&self) -> String {
        let what = match &self.kind {
            DecisionKind::Call { call_id, .. } => call_id.as_str(),
            DecisionKind::Timeout => "~timeout",
            DecisionKind::Cancel => "~cancel",
        };
        format!("{}.{}.{what}", self.invocation_id, self.park_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_approval_is_checked_before_it_is_believed() {
        let ok = Approval::decode(br#"{"callId":"c1","decision":"deny","reason":"no"}"#).unwrap();
        assert_eq!(ok.decision, ApprovalDecision::Deny);
        assert_eq!(ok.reason.as_deref(), Some("no"));
        for bad in [
            &br#"{"callId":"c1"}"#[..],
            br#"{"callId":"c1","decision":"maybe"}"#,
            br#"{"callId":"c 1","decision":"approve"}"#,
            br#"{"callId":"c1","decision":"approve","extra":1}"#,
            b"not json",
        ] {
            assert!(
                Approval::decode(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = format!(
            r#"{{"callId":"c1","decision":"deny","reason":"{}"}}"#,
            "x".repeat(MAX_REASON_CHARS + 1)
        );
        assert!(Approval::decode(long.as_bytes()).is_err());
        let huge = vec![b' '; MAX_APPROVAL_BYTES + 1];
        assert!(matches!(
            Approval::decode(&huge),
            Err(ProtocolError::TooLarge { .. })
        ));
    }

    #[test]
    fn decisions_have_one_message_id_per_call_timeout_and_cancel() {
        let d = |kind| Decision {
            invocation_id: "inv".into(),
            park_id: "p1".into(),
            kind,
            at_ms: 1,
        };
        let call = |decision| DecisionKind::Call {
            call_id: "c1".into(),
            decision,
            reason: None,
            approver: None,
        };
        // Approve and deny of one call share an id: the first one wins.
        assert_eq!(
            d(call(ApprovalDecision::Approve)).msg_id(),
            d(call(ApprovalDecision::Deny)).msg_id()
        );
        assert_ne!(
            d(DecisionKind::Timeout).msg_id(),
            d(DecisionKind::Cancel).msg_id()
        );
        let back: Decision =
            serde_json::from_str(&serde_json::to_string(&d(DecisionKind::Timeout)).unwrap())
                .unwrap();
        assert_eq!(back.kind, DecisionKind::Timeout);
    }
}
