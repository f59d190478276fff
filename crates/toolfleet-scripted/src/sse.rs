//! Streamed bodies, whichever API shape: the frames of an answer tagged
//! with where they sit in it, how text and arguments are split into
//! frames, how the stream faults (`cutMidToolCall`, `cutMidText`,
//! `malformedChunk`) bend the frames, and the body that feeds them out at
//! the script's pace while counting how it ended
//! ([`StreamStats`](crate::StreamStats)).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};

use crate::fault::FaultKind;
use crate::state::ServerState;

/// Words per streamed answer chunk.
const WORDS_PER_CHUNK: usize = 3;
/// Characters per streamed tool-argument fragment.
pub(crate) const ARGUMENT_FRAGMENT_CHARS: usize = 6;
/// Pause before a scripted cut, so the frames before it are flushed to the
/// client first rather than lost with the connection.
const CUT_FLUSH_PAUSE: Duration = Duration::from_millis(20);

/// Where a streamed frame sits in the answer, so faults can cut at the
/// right place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tag {
    Other,
    /// A text or refusal delta.
    Text,
    /// The first frame of call number `n` (its id and name).
    CallHead(usize),
    /// An argument fragment of call number `call`.
    CallArgs {
        call: usize,
    },
}

/// One frame of a streamed body, already in wire form.
#[derive(Debug)]
pub(crate) struct Piece {
    pub(crate) tag: Tag,
    pub(crate) frame: Bytes,
}

/// A few words at a time, whitespace kept, so the pieces concatenate back
/// to the text.
pub(crate) fn answer_pieces(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_inclusive(char::is_whitespace).collect();
    words
        .chunks(WORDS_PER_CHUNK)
        .map(|group| group.concat())
        .collect()
}

/// `text` in pieces of at most `size` characters.
pub(crate) fn fragments(text: &str, size: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let cut = rest.char_indices().nth(size).map_or(rest.len(), |(i, _)| i);
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    pieces
}

/// Applies a stream fault to the frames of a normal answer. Returns the
/// frames to send and whether to drop the connection after them.
pub(crate) fn apply_stream_fault(
    pieces: Vec<Piece>,
    fault: Option<&FaultKind>,
    malformed: &str,
) -> (Vec<Bytes>, bool) {
    match fault {
        Some(FaultKind::CutMidToolCall) => {
            let fragments = pieces
                .iter()
                .filter(|p| p.tag == Tag::CallArgs { call: 0 })
                .count();
            let keep = fragments / 2;
            let mut sent_args = 0;
            let mut frames = Vec::new();
            for piece in pieces {
                let tag = piece.tag;
                frames.push(piece.frame);
                if tag == (Tag::CallArgs { call: 0 }) {
                    sent_args += 1;
                }
                let past_head = tag == Tag::CallHead(0) || tag == (Tag::CallArgs { call: 0 });
                if past_head && sent_args >= keep {
                    break;
                }
            }
            (frames, true)
        }
        Some(FaultKind::CutMidText) => {
            let mut frames = Vec::new();
            for piece in pieces {
                frames.push(piece.frame);
                if piece.tag == Tag::Text {
                    break;
                }
            }
            (frames, true)
        }
        Some(FaultKind::MalformedChunk) => {
            let mut frames: Vec<Bytes> = pieces.into_iter().map(|p| p.frame).collect();
            let at = frames.len().min(1);
            frames.insert(at, Bytes::from(malformed.to_owned()));
            (frames, false)
        }
        _ => (pieces.into_iter().map(|p| p.frame).collect(), false),
    }
}

/// Counts a streamed body in [`StreamStats`](crate::StreamStats); a body
/// dropped before it ended counts as `dropped`.
struct StreamGuard {
    state: Arc<ServerState>,
    ended: bool,
}

impl StreamGuard {
    fn new(state: Arc<ServerState>) -> Self {
        state.streams.send_modify(|s| s.started += 1);
        Self {
            state,
            ended: false,
        }
    }

    fn end(&mut self, cut: bool) {
        if !self.ended {
            self.ended = true;
            self.state.streams.send_modify(|s| {
                if cut {
                    s.cut += 1;
                } else {
                    s.completed += 1;
                }
            });
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.state.streams.send_modify(|s| s.dropped += 1);
        }
    }
}

/// What a streamed body still has to send.
struct Feed {
    frames: VecDeque<Bytes>,
    cut: bool,
    first_delay: Duration,
    delay: Duration,
    sent: usize,
    guard: StreamGuard,
}

/// A body that sends `frames` (pausing `delay` before each, and
/// `first_delay` more before the first), then ends, or with `cut` drops the
/// connection mid-body the way a crashed upstream does.
pub(crate) fn feed_body(
    state: &Arc<ServerState>,
    frames: Vec<Bytes>,
    cut: bool,
    first_delay: Duration,
    delay: Duration,
) -> Body {
    let feed = Feed {
        frames: frames.into(),
        cut,
        first_delay,
        delay,
        sent: 0,
        guard: StreamGuard::new(state.clone()),
    };
    let stream = futures::stream::unfold(feed, |mut feed| async move {
        if let Some(frame) = feed.frames.pop_front() {
            let pause = if feed.sent == 0 {
                feed.first_delay + feed.delay
            } else {
                feed.delay
            };
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            feed.sent += 1;
            return Some((Ok(frame), feed));
        }
        if feed.cut && !feed.guard.ended {
            tokio::time::sleep(CUT_FLUSH_PAUSE).await;
            feed.guard.end(true);
            // An error from the body makes hyper drop the connection
            // without the final empty chunk: the client sees a body that
            // broke off, not one that ended.
            let cut = std::io::Error::other("scripted fault: the stream is cut here");
            return Some((Err(cut), feed));
        }
        feed.guard.end(false);
        None
    });
    Body::from_stream(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::doc_markers;

    #[test]
    fn markers_and_fragments() {
        assert_eq!(
            doc_markers("a [doc:1] b [doc:12][doc:x_y] [doc:] [doc:3 [doc:[doc:4]"),
            ["[doc:1]", "[doc:12]", "[doc:x_y]", "[doc:4]"]
        );
        assert_eq!(fragments("{\"q\":\"é🐝\"}", 4), ["{\"q\"", ":\"é🐝", "\"}"]);
        assert_eq!(answer_pieces("a b  c d\ne").concat(), "a b  c d\ne");
        assert_eq!(
            answer_pieces("one two three four"),
            ["one two three ", "four"]
        );
    }
}
