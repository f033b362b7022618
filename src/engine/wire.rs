//! Byte-stream framing shared by the adapters: splitting an HTTP body into
//! lines as it arrives (SSE `data:` lines, NDJSON objects).

use std::collections::VecDeque;

use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::{EngineChunk, EngineError, EngineStream};

/// Turns a body into complete lines (without the line ending).
#[derive(Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    pub fn push(&mut self, data: &[u8], out: &mut Vec<String>) {
        self.buf.extend_from_slice(data);
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let line = &self.buf[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            out.push(String::from_utf8_lossy(line).into_owned());
            start = end + 1;
        }
        self.buf.drain(..start);
    }

    /// The unterminated rest, if any.
    pub fn finish(&mut self) -> Option<String> {
        if self.buf.is_empty() {
            None
        } else {
            let s = String::from_utf8_lossy(&self.buf).into_owned();
            self.buf.clear();
            Some(s)
        }
    }
}

/// What a protocol does with each line.
pub trait LineDecoder: Send + 'static {
    /// Appends chunks decoded from `line`. Returns `Ok(true)` when the
    /// protocol says the answer is complete.
    fn line(&mut self, line: &str, out: &mut VecDeque<EngineChunk>) -> Result<bool, EngineError>;

    /// Called when the body ends without the end marker. Returns whether what
    /// was received is nevertheless a complete answer.
    fn eof(&mut self, _out: &mut VecDeque<EngineChunk>) -> bool {
        false
    }
}

struct State<S, D> {
    body: S,
    split: LineSplitter,
    decoder: D,
    pending: VecDeque<EngineChunk>,
    lines: Vec<String>,
    /// Delivered after the pending chunks, then the stream ends.
    error: Option<EngineError>,
    finished: bool,
}

/// Decodes a streamed HTTP body line by line. A body that ends before the
/// decoder saw the end of the answer yields [`EngineError::Truncated`] after
/// the chunks it did carry.
pub fn decode_lines<S, D>(body: S, decoder: D) -> EngineStream
where
    S: Stream<Item = Result<Bytes, reqwest::Error>> + Send + Unpin + 'static,
    D: LineDecoder,
{
    let state = State {
        body,
        split: LineSplitter::default(),
        decoder,
        pending: VecDeque::new(),
        lines: Vec::new(),
        error: None,
        finished: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(c) = st.pending.pop_front() {
                return Some((Ok(c), st));
            }
            if let Some(e) = st.error.take() {
                st.finished = true;
                return Some((Err(e), st));
            }
            if st.finished {
                return None;
            }
            match st.body.next().await {
                Some(Ok(bytes)) => {
                    st.split.push(&bytes, &mut st.lines);
                    let lines = std::mem::take(&mut st.lines);
                    for line in &lines {
                        match st.decoder.line(line, &mut st.pending) {
                            Ok(true) => {
                                st.finished = true;
                                break;
                            }
                            Ok(false) => {}
                            Err(e) => {
                                st.error = Some(e);
                                break;
                            }
                        }
                    }
                }
                Some(Err(e)) => st.error = Some(EngineError::Protocol(format!("body read failed: {e}"))),
                None => {
                    let mut done = false;
                    if let Some(rest) = st.split.finish() {
                        match st.decoder.line(&rest, &mut st.pending) {
                            Ok(d) => done = d,
                            Err(e) => st.error = Some(e),
                        }
                    }
                    if !done && st.error.is_none() {
                        done = st.decoder.eof(&mut st.pending);
                    }
                    if !done && st.error.is_none() {
                        st.error = Some(EngineError::Truncated);
                    }
                    st.finished = true;
                    if st.pending.is_empty() && st.error.is_none() {
                        return None;
                    }
                    // Pending chunks go out first; the error, if any, after.
                    if st.error.is_some() {
                        st.finished = false;
                    }
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_lines_across_chunk_boundaries() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(b"data: a\r\nda", &mut out);
        s.push(b"ta: b\n\n", &mut out);
        assert_eq!(out, vec!["data: a", "data: b", ""]);
        assert_eq!(s.finish(), None);
        s.push(b"tail", &mut out);
        assert_eq!(s.finish().as_deref(), Some("tail"));
    }
}
