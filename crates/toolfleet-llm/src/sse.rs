//! A server-sent events decoder: arbitrary byte chunks in, complete events
//! out. It follows the WHATWG event-stream rules that matter for model
//! providers: `\n`, `\r\n` and `\r` line ends, multi-line `data:`, comment
//! lines starting with `:`, a leading BOM, and `data: [DONE]` as the end
//! marker of the OpenAI dialect.

use super::LlmError;

/// One dispatched event. `data` holds the `data:` lines joined with `\n`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, when the server named the event (the Responses
    /// API does; Chat Completions does not).
    pub event: Option<String>,
    pub data: String,
    pub id: Option<String>,
}

impl SseEvent {
    /// Whether this is the OpenAI end-of-stream marker `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data.trim() == "[DONE]"
    }
}

/// Largest single event we buffer. A provider chunk is a few hundred bytes;
/// anything near this is a broken or hostile server, and without a bound a
/// line that never ends would grow without limit.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// Incremental SSE decoder. Feed it whatever the transport delivers; it keeps
/// the incomplete tail until the rest arrives.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes not yet consumed as complete lines.
    buf: Vec<u8>,
    /// How far into `buf` we already looked for a line end, so a long line
    /// arriving in small pieces is scanned once, not once per piece.
    scanned: usize,
    /// The event being assembled.
    data: String,
    has_data: bool,
    event: Option<String>,
    id: Option<String>,
    started: bool,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes one chunk of bytes and returns the events it completed, in
    /// order. Fails only when one event grows beyond [`MAX_EVENT_BYTES`].
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, LlmError> {
        self.buf.extend_from_slice(chunk);
        if !self.started {
            // A BOM is only meaningful as the very first bytes of the stream,
            // and it may itself arrive split.
            const BOM: &[u8] = b"\xEF\xBB\xBF";
            if self.buf.len() < BOM.len() && BOM.starts_with(&self.buf) {
                return Ok(Vec::new());
            }
            self.started = true;
            if self.buf.starts_with(BOM) {
                self.buf.drain(..BOM.len());
            }
        }
        let mut events = Vec::new();
        let mut start = 0;
        let mut i = self.scanned;
        while i < self.buf.len() {
            let b = self.buf[i];
            if b != b'\n' && b != b'\r' {
                i += 1;
                continue;
            }
            let next = if b == b'\r' {
                match self.buf.get(i + 1) {
                    Some(b'\n') => i + 2,
                    Some(_) => i + 1,
                    // A `\r` at the end of the chunk may be the first half of
                    // `\r\n`: wait for the next byte before deciding.
                    None => break,
                }
            } else {
                i + 1
            };
            let line = String::from_utf8_lossy(&self.buf[start..i]).into_owned();
            if let Some(event) = self.line(&line) {
                events.push(event);
            }
            start = next;
            i = next;
        }
        self.buf.drain(..start);
        self.scanned = i - start;
        if self.buf.len() + self.data.len() > MAX_EVENT_BYTES {
            return Err(LlmError::protocol(format!(
                "server-sent event larger than {MAX_EVENT_BYTES} bytes"
            )));
        }
        Ok(events)
    }

    /// Ends the stream: a final event that was not followed by a blank line
    /// is still delivered, since some servers close right after the last
    /// `data:` line.
    pub fn finish(mut self) -> Option<SseEvent> {
        if !self.buf.is_empty() {
            let tail = std::mem::take(&mut self.buf);
            let text = String::from_utf8_lossy(&tail);
            let text = text.strip_suffix('\r').unwrap_or(&text).to_owned();
            if let Some(event) = self.line(&text) {
                return Some(event);
            }
        }
        self.dispatch()
    }

    /// Handles one complete line; returns an event when the line is blank.
    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            // `retry` and unknown fields carry nothing we act on.
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        if !self.has_data {
            // Per the spec an event without data is dropped, but the id
            // persists as the last event id.
            return None;
        }
        self.has_data = false;
        Some(SseEvent {
            event,
            data: std::mem::take(&mut self.data),
            id: self.id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in(bytes: &[u8], size: usize) -> Vec<SseEvent> {
        let mut decoder = SseDecoder::new();
        let mut events = Vec::new();
        for chunk in bytes.chunks(size) {
            events.extend(decoder.push(chunk).expect("push"));
        }
        events.extend(decoder.finish());
        events
    }

    fn datas(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn splits_on_every_line_ending_and_any_chunk_size() {
        for input in [
            &b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"[..],
            b"data: one\r\n\r\ndata: two\r\n\r\ndata: [DONE]\r\n\r\n",
            b"data: one\r\rdata: two\r\rdata: [DONE]\r\r",
        ] {
            for size in 1..=input.len() {
                let events = decode_in(input, size);
                assert_eq!(datas(&events), ["one", "two", "[DONE]"], "size {size}");
                assert!(events[2].is_done());
                assert!(!events[0].is_done());
            }
        }
    }

    #[test]
    fn joins_multi_line_data_and_skips_comments() {
        let input =
            b": keep-alive\n\ndata: {\"a\":\ndata:1}\n: in between\nevent: delta\nid: 7\n\n";
        let events = decode_in(input, 3);
        assert_eq!(
            events,
            [SseEvent {
                event: Some("delta".into()),
                data: "{\"a\":\n1}".into(),
                id: Some("7".into())
            }]
        );
    }

    #[test]
    fn field_without_colon_and_only_one_space_stripped() {
        let events = decode_in(b"data\n\ndata:  two spaces\n\n", 1);
        assert_eq!(datas(&events), ["", " two spaces"]);
    }

    #[test]
    fn event_without_data_is_not_dispatched() {
        let events = decode_in(b"event: ping\n\ndata: x\n\n", 2);
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].event, None,
            "event name must not leak into the next event"
        );
    }

    #[test]
    fn trailing_event_without_blank_line_is_delivered_on_finish() {
        assert_eq!(
            datas(&decode_in(b"data: a\n\ndata: last", 4)),
            ["a", "last"]
        );
        assert_eq!(datas(&decode_in(b"data: last\r", 4)), ["last"]);
    }

    #[test]
    fn bom_is_dropped_and_split_utf8_survives() {
        let input = "\u{feff}data: caf\u{e9} \u{1f41d}\n\n".as_bytes();
        for size in 1..=input.len() {
            assert_eq!(datas(&decode_in(input, size)), ["caf\u{e9} \u{1f41d}"]);
        }
    }

    #[test]
    fn refuses_an_endless_line() {
        let mut decoder = SseDecoder::new();
        let chunk = vec![b'x'; 1024 * 1024];
        let mut failed = false;
        for _ in 0..=(MAX_EVENT_BYTES / chunk.len()) {
            if decoder.push(&chunk).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
    }
}
