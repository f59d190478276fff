//! Hostile input against the decoders every process runs on what arrives
//! from NATS: arbitrary bytes, truncated JSON, duplicated and case-varied
//! headers, oversized values. Every outcome is a value or a clear error —
//! never a panic — and nothing names an invocation id that could reach
//! another invocation's subjects or keys.

use async_nats::HeaderMap;
use proptest::prelude::*;
use serde_json::Value;
use toolfleet_protocol::{
    CallContext, ChatJob, Envelope, InvocationContext, ToolJob, ToolReply, headers,
    salvage_invocation_id, valid_invocation_id,
};

/// Header names the decoders read, in any case, plus noise.
fn header_name() -> impl Strategy<Value = String> {
    let known = prop::sample::select(vec![
        headers::INVOCATION_ID,
        headers::CALL_ID,
        headers::TOOL_ID,
        headers::TENANT,
        headers::ATTEMPT,
        headers::REPLY_TO,
        headers::DEADLINE,
        headers::PROVIDER_CONFIDENCE,
        headers::CITATION_FLOOR,
        headers::NATS_MSG_ID,
        "X-Other",
    ]);
    (known, any::<u32>()).prop_map(|(name, mask)| {
        name.chars()
            .enumerate()
            .map(|(i, c)| {
                if mask >> (i % 32) & 1 == 1 {
                    c.to_ascii_lowercase()
                } else {
                    c.to_ascii_uppercase()
                }
            })
            .collect()
    })
}

/// Values as a hostile publisher would send them: ids of other
/// invocations, wildcards, huge, numeric edge cases (no line breaks: the
/// client cannot carry them).
fn header_value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[A-Za-z0-9_-]{1,20}",
        "[ -~]{0,40}",
        Just("toolfleet.reply.>".to_string()),
        Just("*".to_string()),
        Just("18446744073709551616".to_string()),
        Just("-1".to_string()),
        Just("NaN".to_string()),
        "[a-z]{5000,6000}",
        "\\PC{0,30}",
    ]
}

fn header_map() -> impl Strategy<Value = HeaderMap> {
    prop::collection::vec((header_name(), header_value()), 0..12).prop_map(|pairs| {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(k.as_str(), v.as_str());
        }
        h
    })
}

/// A valid chat job's JSON, to cut and corrupt.
fn chat_job_json() -> Vec<u8> {
    serde_json::to_vec(&toolfleet_protocol::client::question("hello")).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn envelopes_decode_or_refuse_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = Envelope::ChatJob.decode_within::<ChatJob>(&bytes, 1 << 20);
        let _ = Envelope::ToolJob.decode::<ToolJob>(&bytes);
        let _ = Envelope::ToolReply.decode::<ToolReply>(&bytes);
        if let Some(id) = salvage_invocation_id(&bytes, None) {
            prop_assert!(valid_invocation_id(&id));
        }
    }

    #[test]
    fn truncated_and_corrupted_jobs_are_clear_errors(cut in 0usize..200, flip in any::<(usize, u8)>()) {
        let json = chat_job_json();
        let cut = cut.min(json.len().saturating_sub(1));
        let e = Envelope::ChatJob.decode_within::<ChatJob>(&json[..cut], 1 << 20).unwrap_err();
        prop_assert!(!e.to_string().is_empty());
        let mut bad = json.clone();
        let at = flip.0 % bad.len();
        bad[at] = flip.1;
        // Either still a job (a harmless change) or a clear error.
        match Envelope::ChatJob.decode_within::<ChatJob>(&bad, 1 << 20) {
            Ok(job) => prop_assert!(valid_invocation_id(&job.invocation_id)),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn oversized_payloads_are_refused_before_parsing(extra in 1usize..4096) {
        let json = chat_job_json();
        let limit = json.len().saturating_sub(extra).max(1);
        let e = Envelope::ChatJob.decode_within::<ChatJob>(&json, limit).unwrap_err();
        prop_assert_eq!(e.code(), "too_large");
    }

    #[test]
    fn hostile_headers_decode_or_refuse(h in header_map(), payload in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(ctx) = InvocationContext::from_headers(&h) {
            prop_assert!(valid_invocation_id(&ctx.invocation_id));
            if let Some(c) = ctx.provider_confidence {
                prop_assert!((0.0..=1.0).contains(&c));
            }
        }
        if let Ok(call) = CallContext::from_headers(&h) {
            prop_assert!(valid_invocation_id(&call.invocation.invocation_id));
            prop_assert!(valid_invocation_id(&call.call_id));
            // What we write back reads back the same.
            let again = CallContext::from_headers(&call.to_headers()).unwrap();
            prop_assert_eq!(again.call_id, call.call_id);
            prop_assert_eq!(again.invocation.invocation_id, call.invocation.invocation_id);
        }
        if let Some(id) = salvage_invocation_id(&payload, Some(&h)) {
            prop_assert!(valid_invocation_id(&id));
        }
        let kept = toolfleet_protocol::dead_letter_headers(Some(&h));
        prop_assert!(kept.keys().all(|k| k.starts_with("Toolfleet-") || k == "traceparent" || k == "Nats-Msg-Id"));
    }

    #[test]
    fn a_tool_reply_never_decodes_into_something_unchecked(v in prop::collection::vec(any::<u8>(), 0..512)) {
        // A reply built around arbitrary text content still round-trips.
        let text = String::from_utf8_lossy(&v).to_string();
        let reply = serde_json::json!({
            "type": "progress", "invocationId": "inv-1", "callId": "call_1", "message": text
        });
        let bytes = serde_json::to_vec(&reply).unwrap();
        let decoded: Result<ToolReply, _> = Envelope::ToolReply.decode(&bytes);
        if let Ok(ToolReply::Progress { message, .. }) = decoded {
            prop_assert_eq!(message, text);
        }
        let _: Option<Value> = serde_json::from_slice(&bytes).ok();
    }
}
