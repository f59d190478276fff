//! What `rmcp` (the SDK `toolfleet mcp serve` is built on) does not speak
//! of MCP 2025-11-25's tasks, added on the wire: the SDK implements a
//! later draft of tasks, whose `tools/call` carries no `task` parameter
//! and whose capabilities and tools declare no task support.
//!
//! - **in**: a `tools/call` whose `params.task` asks for a task, and the
//!   `tasks/*` requests, are renamed `toolfleet/…` ([`TASK_METHODS`]),
//!   which the SDK hands the server as custom requests with their
//!   parameters whole (its typed `tools/call` would drop the `task`, and
//!   it reads `tasks/get` and `tasks/cancel` as its own draft's);
//! - **out**: the `initialize` result declares the `tasks` capability
//!   (`list`, `cancel`, `requests.tools.call`), and every tool of a
//!   `tools/list` result says `execution.taskSupport: "optional"`.
//!
//! Over stdio each line is one message; over streamable HTTP a POST's
//! JSON body is one message (or a batch), and answers are JSON or
//! server-sent events whose `data` lines are messages.

use std::borrow::Cow;

use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

/// The methods a client's task requests are renamed to, and their names
/// in the specification.
pub(crate) const TASK_METHODS: [(&str, &str); 5] = [
    ("toolfleet/tasks/call", "tools/call"),
    ("toolfleet/tasks/get", "tasks/get"),
    ("toolfleet/tasks/result", "tasks/result"),
    ("toolfleet/tasks/cancel", "tasks/cancel"),
    ("toolfleet/tasks/list", "tasks/list"),
];

/// The specification's name of a renamed task request.
pub(crate) fn task_method(renamed: &str) -> Option<&'static str> {
    TASK_METHODS
        .iter()
        .find(|(r, _)| *r == renamed)
        .map(|(_, m)| *m)
}

/// The largest request body read (a larger one is refused with 413).
const MAX_BODY: usize = 16 * 1024 * 1024;

/// The `tasks` capability of 2025-11-25. `list` is declared because
/// every task is bound to its requestor (the spec asks a receiver that
/// cannot identify requestors not to): `tasks/list` lists the caller's
/// own only (see `tasks`).
fn tasks_capability() -> Value {
    json!({ "list": {}, "cancel": {}, "requests": { "tools": { "call": {} } } })
}

/// Applies `f` to each message of `text` (one, or a batch); `None` when
/// nothing changed (or it is not JSON).
fn each_message(text: &[u8], f: fn(&mut Value) -> bool) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(text).ok()?;
    let changed = match &mut value {
        Value::Array(batch) => batch.iter_mut().fold(false, |c, m| f(m) | c),
        message => f(message),
    };
    changed.then(|| serde_json::to_vec(&value).unwrap_or_default())
}

/// A client's message, its task requests renamed.
pub(crate) fn inbound(text: &[u8]) -> Cow<'_, [u8]> {
    if !contains(text, b"\"task") {
        return Cow::Borrowed(text);
    }
    each_message(text, rename_task_request).map_or(Cow::Borrowed(text), Cow::Owned)
}

fn rename_task_request(message: &mut Value) -> bool {
    let Some(method) = message.get("method").and_then(Value::as_str) else {
        return false;
    };
    let asks_task = method == "tools/call"
        && message
            .get("params")
            .and_then(|p| p.get("task"))
            .is_some_and(Value::is_object);
    let renamed = TASK_METHODS
        .iter()
        .find(|(_, m)| *m == method && (method != "tools/call" || asks_task))
        .map(|(r, _)| *r);
    match renamed {
        Some(r) => {
            message["method"] = json!(r);
            true
        }
        None => false,
    }
}

/// A server's message, its `initialize` result declaring tasks and its
/// listed tools their task support.
pub(crate) fn outbound(text: &[u8]) -> Cow<'_, [u8]> {
    if !contains(text, b"\"serverInfo\"") && !contains(text, b"\"inputSchema\"") {
        return Cow::Borrowed(text);
    }
    each_message(text, declare_tasks).map_or(Cow::Borrowed(text), Cow::Owned)
}

fn declare_tasks(message: &mut Value) -> bool {
    let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) else {
        return false;
    };
    if result.contains_key("serverInfo")
        && let Some(capabilities) = result
            .get_mut("capabilities")
            .and_then(Value::as_object_mut)
    {
        capabilities.insert("tasks".into(), tasks_capability());
        return true;
    }
    let Some(tools) = result.get_mut("tools").and_then(Value::as_array_mut) else {
        return false;
    };
    for tool in tools.iter_mut().filter_map(Value::as_object_mut) {
        tool.insert("execution".into(), json!({ "taskSupport": "optional" }));
    }
    true
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Stdin and stdout for the SDK's server, each line passed through
/// [`inbound`] and [`outbound`] on the way; the returned task ends once
/// the server's last line is written out.
pub(crate) fn stdio() -> (
    tokio::io::DuplexStream,
    tokio::io::DuplexStream,
    tokio::task::JoinHandle<()>,
) {
    let (mut to_server, server_in) = tokio::io::duplex(64 * 1024);
    let (server_out, from_server) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).split(b'\n');
        while let Ok(Some(line)) = lines.next_segment().await {
            let line = inbound(&line).into_owned();
            if to_server.write_all(&line).await.is_err()
                || to_server.write_all(b"\n").await.is_err()
            {
                break;
            }
        }
        // Dropping `to_server` tells the server its client is gone.
    });
    let out = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        let mut lines = tokio::io::BufReader::new(from_server).split(b'\n');
        while let Ok(Some(line)) = lines.next_segment().await {
            let line = outbound(&line).into_owned();
            if stdout.write_all(&line).await.is_err()
                || stdout.write_all(b"\n").await.is_err()
                || stdout.flush().await.is_err()
            {
                break;
            }
        }
    });
    (server_in, server_out, out)
}

/// The HTTP middleware: a POST's body through [`inbound`], every answer
/// (JSON, or each event of a stream) through [`outbound`].
pub(crate) async fn http(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (mut parts, body) = request.into_parts();
    let body = if parts.method == axum::http::Method::POST {
        let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
            return (
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                "the request body is too large",
            )
                .into_response();
        };
        let rewritten = Bytes::from(inbound(&bytes).into_owned());
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        axum::body::Body::from(rewritten)
    } else {
        body
    };
    let response = next
        .run(axum::extract::Request::from_parts(parts, body))
        .await;
    let kind = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let (mut parts, body) = response.into_parts();
    if kind.starts_with("application/json") {
        let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
            return axum::http::StatusCode::BAD_GATEWAY.into_response();
        };
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        let out = Bytes::from(outbound(&bytes).into_owned());
        return axum::response::Response::from_parts(parts, axum::body::Body::from(out));
    }
    if kind.starts_with("text/event-stream") {
        return axum::response::Response::from_parts(parts, events(body));
    }
    axum::response::Response::from_parts(parts, body)
}

/// A stream of server-sent events, each event's `data` lines through
/// [`outbound`], passed on event by event.
fn events(body: axum::body::Body) -> axum::body::Body {
    let stream = futures::stream::unfold(
        (body.into_data_stream(), Vec::<u8>::new(), false),
        |(mut inner, mut buffer, ended)| async move {
            loop {
                if let Some(at) = find(&buffer, b"\n\n") {
                    let event: Vec<u8> = buffer.drain(..at + 2).collect();
                    let out = Ok::<_, axum::Error>(Bytes::from(event_out(&event)));
                    return Some((out, (inner, buffer, ended)));
                }
                if ended {
                    if buffer.is_empty() {
                        return None;
                    }
                    let rest = Bytes::from(std::mem::take(&mut buffer));
                    return Some((Ok(rest), (inner, buffer, true)));
                }
                match inner.next().await {
                    Some(Ok(chunk)) => buffer.extend_from_slice(&chunk),
                    Some(Err(e)) => return Some((Err(e), (inner, buffer, true))),
                    None => {
                        return (!buffer.is_empty()).then(|| {
                            let rest = Bytes::from(std::mem::take(&mut buffer));
                            (Ok(rest), (inner, buffer, true))
                        });
                    }
                }
            }
        },
    );
    axum::body::Body::from_stream(stream)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One event, its `data:` lines rewritten.
fn event_out(event: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len());
    for line in event.split_inclusive(|b| *b == b'\n') {
        match line.strip_prefix(b"data:") {
            Some(data) => {
                let (data, newline) = match data.strip_suffix(b"\n") {
                    Some(d) => (d, true),
                    None => (data, false),
                };
                let data = data.strip_prefix(b" ").unwrap_or(data);
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&outbound(data));
                if newline {
                    out.push(b'\n');
                }
            }
            None => out.extend_from_slice(line),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_requests_are_renamed_and_other_messages_pass_unchanged() {
        let call = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"t","arguments":{"task":"x"},"task":{"ttl":5000}}}"#;
        let out: Value = serde_json::from_slice(&inbound(call)).unwrap();
        assert_eq!(out["method"], "toolfleet/tasks/call");
        assert_eq!(out["params"]["task"]["ttl"], 5000);
        assert_eq!(task_method("toolfleet/tasks/call"), Some("tools/call"));
        let get = br#"{"jsonrpc":"2.0","id":5,"method":"tasks/get","params":{"taskId":"inv-1"}}"#;
        let out: Value = serde_json::from_slice(&inbound(get)).unwrap();
        assert_eq!(out["method"], "toolfleet/tasks/get");
        let plain = br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"t","arguments":{"task":"x"}}}"#;
        assert!(matches!(inbound(plain), Cow::Borrowed(_)));
        assert!(matches!(inbound(b"not json \"task\""), Cow::Borrowed(_)));
        assert_eq!(task_method("tools/call"), None);
    }

    #[test]
    fn initialize_declares_tasks_and_listed_tools_their_support() {
        let init = br#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-11-25","capabilities":{"tools":{}},"serverInfo":{"name":"toolfleet","version":"0"}}}"#;
        let out: Value = serde_json::from_slice(&outbound(init)).unwrap();
        assert_eq!(out["result"]["capabilities"]["tasks"], tasks_capability());
        let list = br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"a","inputSchema":{"type":"object"}}]}}"#;
        let out: Value = serde_json::from_slice(&outbound(list)).unwrap();
        assert_eq!(
            out["result"]["tools"][0]["execution"]["taskSupport"],
            "optional"
        );
    }

    #[test]
    fn an_events_data_lines_are_rewritten_and_the_rest_kept() {
        let event = b"id: 1\ndata: {\"jsonrpc\":\"2.0\",\"id\":0,\"result\":{\"capabilities\":{},\"serverInfo\":{}}}\n\n";
        let out = String::from_utf8(event_out(event)).unwrap();
        assert!(out.starts_with("id: 1\ndata: {"), "{out}");
        assert!(out.ends_with("}\n\n"), "{out}");
        assert!(out.contains("\"tasks\""), "{out}");
        let ping = b": ping\n\n";
        assert_eq!(event_out(ping), ping);
    }
}
