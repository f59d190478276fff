//! The Responses API's shapes: one `response` object, or its events
//! (`event: <type>` and `data: <json>`, numbered by `sequence_number`) as
//! api.openai.com sends them: `response.created`, `response.in_progress`,
//! the message item (`output_item.added`, `content_part.added`,
//! `output_text.delta` with `output_text.annotation.added` for each
//! citation, `output_text.done`, `content_part.done`, `output_item.done`)
//! and `response.completed`. Calls held for approval are
//! `mcp_approval_request` output items (server label `toolfleet`) of a
//! completed response, as the API answers a remote MCP server's tool that
//! needs approval. A failure midway is an `error` event, then
//! `response.failed`.

use serde_json::{Value, json};
use toolfleet_protocol::usage::Usage;

use super::answer::{Citation, Collected, Held, Output, responses_usage};
use super::stream::{Frames, Meta, event_frame};

fn annotation(c: &Citation) -> Value {
    json!({
        "type": "url_citation",
        "start_index": c.start,
        "end_index": c.end,
        "url": c.url,
        "title": c.title,
    })
}

/// The `mcp_approval_request` item of a held call.
fn approval_item(h: &Held) -> Value {
    json!({
        "type": "mcp_approval_request",
        "id": format!("mcpr_{}", h.call_id),
        "name": h.tool,
        "arguments": h.arguments.to_string(),
        "server_label": "toolfleet",
    })
}

fn message_id(meta: &Meta) -> String {
    format!("msg_{}", meta.invocation_id)
}

fn output_text(text: &str, citations: &[Citation]) -> Value {
    json!({
        "type": "output_text",
        "text": text,
        "annotations": citations.iter().map(annotation).collect::<Vec<_>>(),
        "logprobs": [],
    })
}

fn message_item(meta: &Meta, status: &str, content: Vec<Value>) -> Value {
    json!({
        "id": message_id(meta),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// A response object: `status` with these output items.
pub(crate) fn response(
    meta: &Meta,
    status: &str,
    output: Vec<Value>,
    usage: Option<&Usage>,
    error: Option<Value>,
) -> Value {
    json!({
        "id": format!("resp_{}", meta.invocation_id),
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "background": false,
        "error": error,
        "incomplete_details": null,
        "instructions": null,
        "max_output_tokens": null,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": { "effort": null, "summary": null },
        "store": false,
        "temperature": null,
        "text": { "format": { "type": "text" } },
        "tool_choice": "auto",
        "tools": [],
        "top_p": null,
        "truncation": "disabled",
        "usage": usage.map(responses_usage),
        "user": null,
        "metadata": {},
    })
}

/// The whole answer as one response object.
pub(crate) fn complete(meta: &Meta, c: &Collected) -> Value {
    let mut output = Vec::new();
    if !c.text.is_empty() || c.held.is_empty() {
        output.push(message_item(
            meta,
            "completed",
            vec![output_text(&c.text, &c.citations)],
        ));
    }
    output.extend(c.held.iter().map(approval_item));
    response(meta, "completed", output, c.usage.as_ref(), None)
}

/// The events of a streamed answer.
pub(crate) struct ResponseEvents {
    meta: Meta,
    sequence: u64,
    /// The message item is open (its `added` events are out).
    open: bool,
    text: String,
    citations: Vec<Citation>,
    /// Items done so far, for the final response.
    done: Vec<Value>,
}

impl ResponseEvents {
    pub(crate) fn new(meta: Meta) -> Self {
        Self {
            meta,
            sequence: 0,
            open: false,
            text: String::new(),
            citations: Vec::new(),
            done: Vec::new(),
        }
    }

    fn event(&mut self, kind: &str, mut fields: Value) -> String {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        event_frame(kind, &fields)
    }

    /// The message item's part, where `added`, `delta` and `done` events
    /// point.
    fn at(&self) -> Value {
        json!({ "item_id": message_id(&self.meta), "output_index": 0, "content_index": 0 })
    }

    fn with_at(&self, extra: Value) -> Value {
        let mut v = self.at();
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        v
    }

    fn open_message(&mut self) -> Vec<String> {
        self.open = true;
        let item = message_item(&self.meta, "in_progress", Vec::new());
        let added = self.event(
            "response.output_item.added",
            json!({ "output_index": 0, "item": item }),
        );
        let part = self.with_at(json!({ "part": output_text("", &[]) }));
        vec![added, self.event("response.content_part.added", part)]
    }

    fn text(&mut self, text: String, citations: Vec<Citation>) -> Vec<String> {
        let mut out = if self.open {
            Vec::new()
        } else {
            self.open_message()
        };
        self.text.push_str(&text);
        let delta = self.with_at(json!({ "delta": text, "logprobs": [] }));
        out.push(self.event("response.output_text.delta", delta));
        for c in citations {
            let a = self.with_at(json!({
                "annotation_index": self.citations.len(),
                "annotation": annotation(&c),
            }));
            out.push(self.event("response.output_text.annotation.added", a));
            self.citations.push(c);
        }
        out
    }

    /// The message item's `done` events (it is opened first when no text
    /// came, unless calls wait for approval instead).
    fn close_message(&mut self, empty_is_nothing: bool) -> Vec<String> {
        if !self.open && empty_is_nothing {
            return Vec::new();
        }
        let mut out = if self.open {
            Vec::new()
        } else {
            self.open_message()
        };
        let part = output_text(&self.text, &self.citations);
        let done = self.with_at(json!({ "text": self.text, "logprobs": [] }));
        out.push(self.event("response.output_text.done", done));
        let part_done = self.with_at(json!({ "part": part.clone() }));
        out.push(self.event("response.content_part.done", part_done));
        let item = message_item(&self.meta, "completed", vec![part]);
        out.push(self.event(
            "response.output_item.done",
            json!({ "output_index": 0, "item": item.clone() }),
        ));
        self.done.push(item);
        out
    }

    fn completed(&mut self, usage: Option<&Usage>) -> String {
        let r = response(&self.meta, "completed", self.done.clone(), usage, None);
        self.event("response.completed", json!({ "response": r }))
    }
}

impl Frames for ResponseEvents {
    fn open(&mut self) -> Vec<String> {
        let r = response(&self.meta, "in_progress", Vec::new(), None, None);
        vec![
            self.event("response.created", json!({ "response": r.clone() })),
            self.event("response.in_progress", json!({ "response": r })),
        ]
    }

    fn on(&mut self, out: Output) -> Vec<String> {
        match out {
            Output::Progress => Vec::new(),
            Output::Text { text, citations } => self.text(text, citations),
            Output::Done { usage } => {
                let mut out = self.close_message(false);
                out.push(self.completed(Some(&usage)));
                out
            }
            Output::Approval(held) => {
                let mut out = self.close_message(true);
                for h in &held {
                    let index = self.done.len();
                    let item = approval_item(h);
                    out.push(self.event(
                        "response.output_item.added",
                        json!({ "output_index": index, "item": item.clone() }),
                    ));
                    out.push(self.event(
                        "response.output_item.done",
                        json!({ "output_index": index, "item": item.clone() }),
                    ));
                    self.done.push(item);
                }
                out.push(self.completed(None));
                out
            }
            Output::Failed(e) => {
                let error = json!({
                    "code": e.code,
                    "message": e.message,
                    "param": e.param,
                });
                let failed = response(
                    &self.meta,
                    "failed",
                    self.done.clone(),
                    None,
                    Some(json!({ "code": e.code, "message": e.message })),
                );
                vec![
                    self.event("error", error),
                    self.event("response.failed", json!({ "response": failed })),
                ]
            }
        }
    }
}
