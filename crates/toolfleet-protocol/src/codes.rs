//! The fleet's error codes, said once here and serialised as the strings
//! clients match on: [`ChatErrorCode`], why an invocation ended without an
//! answer (the `code` of its `error` event), and [`ToolErrorCode`], why a
//! tool call did (a tool result's `error.code`, a `tool_result` event's
//! `errorCode`). The schemas list the same fixed codes (tests check they
//! agree).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The `code` of an `error` chat event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ChatErrorCode {
    /// The job could not be decoded (size, JSON, schema).
    MalformedJob,
    /// Another chat job holds the invocation id.
    DuplicateInvocation,
    /// The job names another tenant than its submit subject's.
    TenantMismatch,
    /// Delivered more often than it may run.
    TooManyAttempts,
    /// The job's NATS headers cannot be read.
    UnreadableHeaders,
    /// The invocation was cancelled.
    Cancelled,
    /// No answer within the job's timeout (counted from submission).
    DeadlineExceeded,
    /// A bug; the orchestrator's log says more.
    InternalError,
    /// The loop policy's round limit was hit (or the model asked for tools
    /// after being told to answer).
    RoundLimit,
    /// The model ran out of tokens while writing a tool call.
    TruncatedToolCall,
    /// Two tool calls were given the same citation index.
    CitationConflict,
    /// The job's (or its profile's) sink was refused.
    InvalidSink,
    /// The job's `tools` name tools it may not select.
    InvalidToolSelection,
    /// A call needs approval but the invocation cannot be parked.
    ApprovalUnavailable,
    /// No approval arrived in time.
    ApprovalTimeout,
    /// The profile's deployment cannot be used (its client cannot be built,
    /// or no key).
    BadDeployment,
    /// The profile names no usable deployment.
    NoDeployment,
    /// The default profile is not configured (a configuration built in
    /// code; a loaded file always has it).
    NoProfile,
    /// The answer does not fit in a NATS message.
    AnswerTooLarge,
    /// The job names a profile that is not configured (never run on
    /// another one instead).
    UnknownProfile,
    /// The job's tenant may not use the profile (the one it named, or its
    /// default).
    ProfileNotAllowed,
    /// The job's tenant may not use a data source it names (its
    /// `dataSourceId`, or the collection of an attached document).
    DataSourceNotAllowed,
    /// The job's tenant is suspended: too many of its chat jobs could not
    /// be read (the operator's poison guard); the job did not run.
    TenantSuspended,
    /// The job's tenant had its cap of queued jobs (`max_queued_jobs`)
    /// ahead of it.
    QueueFull,
    /// The job's tenant has its cap of parked invocations (`max_parked`),
    /// or the parked bucket is full.
    TooManyParked,
    /// The tenant is over a rate limit of the operator's
    /// (`requests_per_minute`, `tokens_per_minute`): the `error` event's
    /// `retryAfterMs` says when a model call would be admitted again.
    RateLimited,
    /// The tenant's spend budget for the day or the month
    /// (`spend_per_day_usd`, `spend_per_month_usd`) is spent: no model call
    /// is made until it renews (`retryAfterMs`).
    BudgetExhausted,
    /// The invocation used the tokens or spend one run may use
    /// (`max_run_tokens`, `max_run_spend_usd`): it ends before its next
    /// model call.
    RunLimitExceeded,
    /// The job's thread has a job running and the job's strategy is
    /// `reject` (`docs/threads.md`): it did not run.
    ThreadBusy,
    /// The job's `idempotencyKey` was first used (within the window) by a
    /// job of another body (`docs/threads.md`): it did not run.
    IdempotencyMismatch,
    /// The model provider failed: `llm_<kind>`, the kind being the
    /// provider client's error code (`http_429`, `timeout`, a provider's
    /// own code).
    Llm(String),
    /// A custom orchestrator's own code (`[a-z][a-z0-9_]*`).
    Custom(String),
}

impl ChatErrorCode {
    /// Every code but [`Llm`](Self::Llm) and [`Custom`](Self::Custom), in
    /// the order the schema lists them.
    pub const FIXED: [ChatErrorCode; 30] = [
        Self::MalformedJob,
        Self::DuplicateInvocation,
        Self::TenantMismatch,
        Self::TooManyAttempts,
        Self::UnreadableHeaders,
        Self::Cancelled,
        Self::DeadlineExceeded,
        Self::InternalError,
        Self::RoundLimit,
        Self::TruncatedToolCall,
        Self::CitationConflict,
        Self::InvalidSink,
        Self::InvalidToolSelection,
        Self::ApprovalUnavailable,
        Self::ApprovalTimeout,
        Self::BadDeployment,
        Self::NoDeployment,
        Self::NoProfile,
        Self::AnswerTooLarge,
        Self::UnknownProfile,
        Self::ProfileNotAllowed,
        Self::DataSourceNotAllowed,
        Self::TenantSuspended,
        Self::QueueFull,
        Self::TooManyParked,
        Self::RateLimited,
        Self::BudgetExhausted,
        Self::RunLimitExceeded,
        Self::ThreadBusy,
        Self::IdempotencyMismatch,
    ];

    /// The prefix of a provider failure's code.
    pub const LLM_PREFIX: &str = "llm_";

    /// A provider failure of `kind` (the provider client's code).
    pub fn llm(kind: &str) -> Self {
        Self::Llm(kind.to_string())
    }

    /// The code as clients see it.
    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        let fixed = match self {
            Self::MalformedJob => "malformed_job",
            Self::DuplicateInvocation => "duplicate_invocation",
            Self::TenantMismatch => "tenant_mismatch",
            Self::TooManyAttempts => "too_many_attempts",
            Self::UnreadableHeaders => "unreadable_headers",
            Self::Cancelled => "cancelled",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::InternalError => "internal_error",
            Self::RoundLimit => "round_limit",
            Self::TruncatedToolCall => "truncated_tool_call",
            Self::CitationConflict => "citation_conflict",
            Self::InvalidSink => "invalid_sink",
            Self::InvalidToolSelection => "invalid_tool_selection",
            Self::ApprovalUnavailable => "approval_unavailable",
            Self::ApprovalTimeout => "approval_timeout",
            Self::BadDeployment => "bad_deployment",
            Self::NoDeployment => "no_deployment",
            Self::NoProfile => "no_profile",
            Self::AnswerTooLarge => "answer_too_large",
            Self::UnknownProfile => "unknown_profile",
            Self::ProfileNotAllowed => "profile_not_allowed",
            Self::DataSourceNotAllowed => "data_source_not_allowed",
            Self::TenantSuspended => "tenant_suspended",
            Self::QueueFull => "queue_full",
            Self::TooManyParked => "too_many_parked",
            Self::RateLimited => "rate_limited",
            Self::BudgetExhausted => "budget_exhausted",
            Self::RunLimitExceeded => "run_limit_exceeded",
            Self::ThreadBusy => "thread_busy",
            Self::IdempotencyMismatch => "idempotency_mismatch",
            Self::Llm(kind) => return format!("{}{kind}", Self::LLM_PREFIX).into(),
            Self::Custom(code) => return code.as_str().into(),
        };
        fixed.into()
    }

    /// The code a string names: a fixed one, a provider failure, or a
    /// custom one.
    pub fn parse(code: &str) -> Self {
        if let Some(fixed) = Self::FIXED.iter().find(|c| c.as_str() == code) {
            return fixed.clone();
        }
        match code.strip_prefix(Self::LLM_PREFIX) {
            Some(kind) => Self::Llm(kind.to_string()),
            None => Self::Custom(code.to_string()),
        }
    }
}

impl fmt::Display for ChatErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

impl From<&str> for ChatErrorCode {
    fn from(code: &str) -> Self {
        Self::parse(code)
    }
}

impl From<String> for ChatErrorCode {
    fn from(code: String) -> Self {
        Self::parse(&code)
    }
}

impl From<ChatErrorCode> for String {
    fn from(code: ChatErrorCode) -> Self {
        code.as_str().into_owned()
    }
}

impl PartialEq<&str> for ChatErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<str> for ChatErrorCode {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl Serialize for ChatErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.as_str())
    }
}

impl<'de> Deserialize<'de> for ChatErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let code = String::deserialize(d)?;
        Ok(Self::parse(&code))
    }
}

/// Why a tool call did not succeed: a tool result's `error.code` and a
/// `tool_result` event's `errorCode`, as the worker SDK and the
/// orchestrator set them; a tool may also answer with its own code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ToolErrorCode {
    /// The arguments are not JSON, or do not match the tool's parameters.
    InvalidArguments,
    /// The tool said its input cannot be used.
    InvalidInput,
    /// No offered or permitted tool has the name the model called.
    UnknownTool,
    /// No live worker serves the tool.
    NoWorker,
    /// The job would not fit in a NATS message.
    TooLarge,
    /// The job could not be published.
    DispatchFailed,
    /// A deployment's `before_call` policy refused the call.
    ToolCallRefused,
    /// No result within the tool's timeout.
    Timeout,
    /// More calls in the turn than the loop policy allows.
    CallsPerTurn,
    /// The invocation was cancelled.
    Cancelled,
    /// This one call was cancelled (`toolfleet cancel INV --call CALL`).
    CallCancelled,
    /// A person denied the call.
    ApprovalDenied,
    /// The call was never approved.
    ApprovalMissing,
    /// The call needs approval and nobody can give it (an agent's job).
    ApprovalUnavailable,
    /// `search_tools` may add no more tools.
    ExpansionCapped,
    /// The job reached a worker that does not serve its tool.
    WrongTool,
    /// The worker cannot reach its store (Redis).
    StoreUnavailable,
    /// The job's NATS headers cannot be read.
    UnreadableHeaders,
    /// The invocation's deadline passed before the call could run.
    DeadlineExceeded,
    /// The job's reply subject is not one of the fleet's.
    BadReplySubject,
    /// The tool failed.
    ToolFailed,
    /// The tool failed in a way a retry may cure (retries used up).
    TransientFailure,
    /// The tool refused (a policy of its own).
    Blocked,
    /// The result was sent but could not be kept in the ledger.
    LedgerNotWritten,
    /// The result does not fit in a NATS message.
    ResultTooLarge,
    /// The tool's model call would pass a rate limit of the tenant's
    /// (requests or tokens per minute): not retried by the worker.
    RateLimited,
    /// The tool's model call would pass a budget of the tenant's (spend
    /// per day or month).
    BudgetExhausted,
    /// A tool's own code.
    Custom(String),
}

impl ToolErrorCode {
    /// Every code but [`Custom`](Self::Custom), in the order the schemas
    /// list them.
    pub const FIXED: [ToolErrorCode; 27] = [
        Self::InvalidArguments,
        Self::InvalidInput,
        Self::UnknownTool,
        Self::NoWorker,
        Self::TooLarge,
        Self::DispatchFailed,
        Self::ToolCallRefused,
        Self::Timeout,
        Self::CallsPerTurn,
        Self::Cancelled,
        Self::CallCancelled,
        Self::ApprovalDenied,
        Self::ApprovalMissing,
        Self::ApprovalUnavailable,
        Self::ExpansionCapped,
        Self::WrongTool,
        Self::StoreUnavailable,
        Self::UnreadableHeaders,
        Self::DeadlineExceeded,
        Self::BadReplySubject,
        Self::ToolFailed,
        Self::TransientFailure,
        Self::Blocked,
        Self::LedgerNotWritten,
        Self::ResultTooLarge,
        Self::RateLimited,
        Self::BudgetExhausted,
    ];

    /// The code as clients see it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::InvalidArguments => "invalid_arguments",
            Self::InvalidInput => "invalid_input",
            Self::UnknownTool => "unknown_tool",
            Self::NoWorker => "no_worker",
            Self::TooLarge => "too_large",
            Self::DispatchFailed => "dispatch_failed",
            Self::ToolCallRefused => "tool_call_refused",
            Self::Timeout => "timeout",
            Self::CallsPerTurn => "calls_per_turn",
            Self::Cancelled => "cancelled",
            Self::CallCancelled => "call_cancelled",
            Self::ApprovalDenied => "approval_denied",
            Self::ApprovalMissing => "approval_missing",
            Self::ApprovalUnavailable => "approval_unavailable",
            Self::ExpansionCapped => "expansion_capped",
            Self::WrongTool => "wrong_tool",
            Self::StoreUnavailable => "store_unavailable",
            Self::UnreadableHeaders => "unreadable_headers",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::BadReplySubject => "bad_reply_subject",
            Self::ToolFailed => "tool_failed",
            Self::TransientFailure => "transient_failure",
            Self::Blocked => "blocked",
            Self::LedgerNotWritten => "ledger_not_written",
            Self::ResultTooLarge => "result_too_large",
            Self::RateLimited => "rate_limited",
            Self::BudgetExhausted => "budget_exhausted",
            Self::Custom(code) => code,
        }
    }

    /// The code a string names: a fixed one, or a tool's own.
    pub fn parse(code: &str) -> Self {
        Self::FIXED
            .iter()
            .find(|c| c.as_str() == code)
            .cloned()
            .unwrap_or_else(|| Self::Custom(code.to_string()))
    }
}

impl fmt::Display for ToolErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ToolErrorCode> for String {
    fn from(code: ToolErrorCode) -> Self {
        code.as_str().to_string()
    }
}

impl PartialEq<&str> for ToolErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_as_strings() {
        for code in ChatErrorCode::FIXED {
            assert_eq!(ChatErrorCode::parse(&code.as_str()), code);
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(serde_json::from_str::<ChatErrorCode>(&json).unwrap(), code);
        }
        assert_eq!(ChatErrorCode::llm("http_429").as_str(), "llm_http_429");
        assert_eq!(
            ChatErrorCode::parse("llm_timeout"),
            ChatErrorCode::llm("timeout")
        );
        assert_eq!(
            ChatErrorCode::parse("clock_failed"),
            ChatErrorCode::Custom("clock_failed".into())
        );
        assert_eq!(ChatErrorCode::Cancelled, "cancelled");
    }

    /// The schema's list of fixed codes is this enum's.
    #[test]
    fn the_schema_lists_every_fixed_code() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../schemas/chat_event.schema.json"
        );
        let schema: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let listed: Vec<String> = schema["$defs"]["errorCode"]["anyOf"][0]["enum"]
            .as_array()
            .expect("$defs.errorCode.anyOf[0].enum lists the fixed codes")
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        let ours: Vec<String> = ChatErrorCode::FIXED
            .iter()
            .map(|c| c.as_str().into_owned())
            .collect();
        assert_eq!(listed, ours);
        let llm = schema["$defs"]["errorCode"]["anyOf"][1]["pattern"]
            .as_str()
            .unwrap();
        assert_eq!(llm, "^llm_[a-z0-9_]+$");
    }

    #[test]
    fn tool_codes_round_trip_and_the_schemas_list_them() {
        for code in ToolErrorCode::FIXED {
            assert_eq!(ToolErrorCode::parse(code.as_str()), code);
        }
        assert_eq!(
            ToolErrorCode::parse("ssrf_blocked"),
            ToolErrorCode::Custom("ssrf_blocked".into())
        );
        let ours: Vec<&str> = ToolErrorCode::FIXED
            .iter()
            .map(ToolErrorCode::as_str)
            .collect();
        for schema in ["tool_reply.schema.json", "chat_event.schema.json"] {
            let path = format!("{}/../../schemas/{schema}", env!("CARGO_MANIFEST_DIR"));
            let schema: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let listed: Vec<&str> = schema["$defs"]["toolErrorCode"]["anyOf"][0]["enum"]
                .as_array()
                .unwrap_or_else(|| panic!("{path}: $defs.toolErrorCode.anyOf[0].enum"))
                .iter()
                .map(|c| c.as_str().unwrap())
                .collect();
            assert_eq!(listed, ours, "{path}");
        }
    }
}
