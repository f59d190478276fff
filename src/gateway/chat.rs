//! Chat Completions' shapes: one `chat.completion` object, or
//! `chat.completion.chunk` frames (`data: {..}`) ending with `data:
//! [DONE]`, as api.openai.com sends them (the first chunk names the role,
//! text in `delta.content`, the citations as one chunk of
//! `delta.annotations` once the text is complete, then `finish_reason`,
//! then with `stream_options.include_usage` a chunk with the usage and no
//! choices). Calls held for approval: `finish_reason` `stop`, content
//! saying what waits, and a `toolfleet` object naming the calls.

use serde_json::{Value, json};

use super::answer::{Citation, Collected, Held, Output, approval_text, chat_usage};
use super::stream::{Frames, Meta, data_frame};

fn annotation(c: &Citation) -> Value {
    json!({
        "type": "url_citation",
        "url_citation": {
            "start_index": c.start,
            "end_index": c.end,
            "url": c.url,
            "title": c.title,
        }
    })
}

/// The `toolfleet` extension of an answer that waits for approvals.
pub(crate) fn waiting(meta: &Meta, held: &[Held]) -> Value {
    json!({
        "status": "approval_required",
        "invocation_id": meta.invocation_id,
        "response_id": format!("resp_{}", meta.invocation_id),
        "approvals": held.iter().map(|h| json!({
            "call_id": h.call_id,
            "tool": h.tool,
            "arguments": h.arguments,
            "expires_at_ms": h.expires_at_ms,
        })).collect::<Vec<_>>(),
    })
}

/// The text shown for held calls, after any text already given.
fn with_approval_text(text: &str, held: &[Held], meta: &Meta) -> String {
    let note = approval_text(held, &meta.invocation_id);
    if text.is_empty() {
        note
    } else {
        format!("{text}\n\n{note}")
    }
}

/// The whole answer as one `chat.completion`.
pub(crate) fn completion(meta: &Meta, c: &Collected) -> Value {
    let content = if c.held.is_empty() {
        c.text.clone()
    } else {
        with_approval_text(&c.text, &c.held, meta)
    };
    let mut body = json!({
        "id": format!("chatcmpl-{}", meta.invocation_id),
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": content,
                "refusal": null,
                "annotations": c.citations.iter().map(annotation).collect::<Vec<_>>(),
            },
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "usage": c.usage.as_ref().map(chat_usage),
    });
    if !c.held.is_empty() {
        body["toolfleet"] = waiting(meta, &c.held);
    }
    body
}

/// The chunks of a streamed answer.
pub(crate) struct ChatChunks {
    meta: Meta,
    include_usage: bool,
    citations: Vec<Citation>,
    text: String,
}

impl ChatChunks {
    pub(crate) fn new(meta: Meta, include_usage: bool) -> Self {
        Self {
            meta,
            include_usage,
            citations: Vec::new(),
            text: String::new(),
        }
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> String {
        data_frame(&self.chunk_value(delta, finish_reason))
    }

    fn chunk_value(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": format!("chatcmpl-{}", self.meta.invocation_id),
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": null,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish_reason,
            }],
        })
    }

    /// The end of an answer: its citations, `finish_reason`, the usage
    /// when asked for, `[DONE]`.
    fn end(
        &mut self,
        usage: Option<&toolfleet_protocol::usage::Usage>,
        extra: Option<Value>,
    ) -> Vec<String> {
        let mut frames = Vec::new();
        if !self.citations.is_empty() {
            let annotations: Vec<Value> = self.citations.iter().map(annotation).collect();
            frames.push(self.chunk(json!({ "annotations": annotations }), None));
        }
        let mut last = self.chunk_value(json!({}), Some("stop"));
        if let Some(extra) = extra {
            last["toolfleet"] = extra;
        }
        frames.push(data_frame(&last));
        if self.include_usage {
            frames.push(data_frame(&json!({
                "id": format!("chatcmpl-{}", self.meta.invocation_id),
                "object": "chat.completion.chunk",
                "created": self.meta.created,
                "model": self.meta.model,
                "system_fingerprint": null,
                "choices": [],
                "usage": usage.map(chat_usage),
            })));
        }
        frames.push("data: [DONE]\n\n".to_string());
        frames
    }
}

impl Frames for ChatChunks {
    fn open(&mut self) -> Vec<String> {
        vec![self.chunk(
            json!({ "role": "assistant", "content": "", "refusal": null }),
            None,
        )]
    }

    fn on(&mut self, out: Output) -> Vec<String> {
        match out {
            Output::Progress => Vec::new(),
            Output::Text { text, citations } => {
                self.text.push_str(&text);
                self.citations.extend(citations);
                vec![self.chunk(json!({ "content": text }), None)]
            }
            Output::Done { usage } => self.end(Some(&usage), None),
            Output::Approval(held) => {
                let note = with_approval_text(&self.text, &held, &self.meta);
                let added = note[self.text.len()..].to_string();
                let mut frames = vec![self.chunk(json!({ "content": added }), None)];
                let extra = waiting(&self.meta, &held);
                frames.extend(self.end(None, Some(extra)));
                frames
            }
            // What api.openai.com sends when a stream fails midway; the
            // official clients raise it.
            Output::Failed(e) => vec![data_frame(&e.body())],
        }
    }
}
