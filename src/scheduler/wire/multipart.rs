//! Reading the `model` field of a `multipart/form-data` body (audio transcriptions and
//! translations), without ever copying the file.
//!
//! Why: routing needs the model, and an audio upload is a form whose `file` part can be many
//! megabytes. Envoy already buffers the body while the filter holds the headers; the filter must
//! not copy it again, must not trust its structure, and should be able to stop reading as soon
//! as the model is known (clients put small fields first: the OpenAI SDK sends `model` before
//! `file`).
//!
//! How: [`ModelScan`] is a push parser fed the body in chunks of any size. It looks for the
//! delimiter `CRLF--boundary`, reads each part's header block (at most
//! [`MAX_PART_HEADER_BYTES`]), and for the part named `model` keeps its value (at most
//! [`MAX_MODEL_BYTES`]). Any other part's content is
//! only scanned for the next delimiter: between chunks the parser keeps at most the delimiter's
//! length minus one byte. Memory is bounded by a few KiB whatever arrives; work is linear in the
//! bytes read. The first `model` part wins; the rest of the body is not validated (the upstream
//! does that).
//!
//! Nothing in a form is a session: fields such as `user` are ignored, so a multipart request has
//! a session only if the session header names one.
//!
//! The parser knows nothing of routing requests: [`crate::scheduler::wire::request::parse_form`]
//! turns its model into one.
//!
//! Syntax followed: RFC 2046 §5.1.1 (boundary of 1–70 characters, delimiter lines with optional
//! transport padding, preamble and epilogue ignored) and RFC 7578 (`Content-Disposition:
//! form-data; name="…"`); lines must end in CRLF.

use crate::scheduler::wire::reply::RejectReason;
use crate::scheduler::wire::MAX_MODEL_BYTES;

/// RFC 2046: a boundary is 1 to 70 characters.
pub const MAX_BOUNDARY_BYTES: usize = 70;
/// Longest header block of one part (real ones are a few hundred bytes).
pub const MAX_PART_HEADER_BYTES: usize = 8 * 1024;
/// Parts read before the model must have been found.
pub const MAX_PARTS: u32 = 1024;
/// Longest transport padding accepted after a delimiter.
const MAX_PADDING: usize = 64;

/// Why a multipart body cannot be routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultipartError {
    /// The content type is not `multipart/form-data`.
    NotMultipartForm,
    /// The content type has no `boundary` parameter.
    MissingBoundary,
    /// The boundary is empty, longer than 70 bytes or not printable ASCII.
    InvalidBoundary,
    /// The body never contains the boundary.
    NoDelimiter,
    /// A delimiter is followed by something other than `--` or padding and CRLF.
    MalformedDelimiter,
    /// A part's header block exceeds [`MAX_PART_HEADER_BYTES`].
    PartHeadersTooLarge,
    /// [`MAX_PARTS`] parts read and none of them is the `model` field.
    TooManyParts,
    /// The body ends inside a part.
    Truncated,
    /// The form has no (or an empty) `model` field.
    MissingModel,
    /// The `model` field exceeds `MAX_MODEL_BYTES`.
    ModelTooLong,
    /// The `model` field is not UTF-8.
    ModelNotUtf8,
}

impl MultipartError {
    /// HTTP status of the answer.
    pub fn status(&self) -> u16 {
        match self {
            MultipartError::NotMultipartForm => 415,
            _ => 400,
        }
    }

    /// The OpenAI-style error `code`.
    pub fn code(&self) -> &'static str {
        self.reason().label()
    }

    /// The reject reason (metric label and error code) of the refusal.
    pub fn reason(&self) -> RejectReason {
        match self {
            MultipartError::NotMultipartForm => RejectReason::UnsupportedContentType,
            MultipartError::MissingModel => RejectReason::MissingModel,
            MultipartError::ModelTooLong | MultipartError::ModelNotUtf8 => {
                RejectReason::InvalidModel
            }
            _ => RejectReason::InvalidMultipart,
        }
    }

    pub fn message(&self) -> String {
        match self {
            MultipartError::NotMultipartForm => {
                "This endpoint takes a multipart/form-data body.".into()
            }
            MultipartError::MissingBoundary => {
                "The multipart/form-data content type has no boundary parameter.".into()
            }
            MultipartError::InvalidBoundary => format!(
                "The multipart boundary must be 1 to {MAX_BOUNDARY_BYTES} printable ASCII characters."
            ),
            MultipartError::NoDelimiter => {
                "The request body does not contain the multipart boundary.".into()
            }
            MultipartError::MalformedDelimiter => {
                "A multipart boundary line is not followed by CRLF or `--`.".into()
            }
            MultipartError::PartHeadersTooLarge => format!(
                "A multipart part's headers exceed {MAX_PART_HEADER_BYTES} bytes."
            ),
            MultipartError::TooManyParts => {
                format!("The form's first {MAX_PARTS} parts have no model field.")
            }
            MultipartError::Truncated => "The multipart body ends inside a part.".into(),
            MultipartError::MissingModel => {
                "You must provide a model parameter (a `model` form field).".into()
            }
            MultipartError::ModelTooLong => {
                format!("The model parameter must be at most {MAX_MODEL_BYTES} bytes.")
            }
            MultipartError::ModelNotUtf8 => "The model parameter must be UTF-8 text.".into(),
        }
    }
}

/// The boundary of a `multipart/form-data` content type (case-insensitive type, the boundary
/// parameter quoted or not).
pub fn boundary(content_type: &str) -> Result<Vec<u8>, MultipartError> {
    let (media, params) = split_header_value(content_type.as_bytes());
    if !media.eq_ignore_ascii_case(b"multipart/form-data") {
        return Err(MultipartError::NotMultipartForm);
    }
    let b = params
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(b"boundary"))
        .map(|(_, v)| v)
        .ok_or(MultipartError::MissingBoundary)?;
    let printable = b.iter().all(|c| (0x20..=0x7e).contains(c));
    if b.is_empty() || b.len() > MAX_BOUNDARY_BYTES || !printable || b.last() == Some(&b' ') {
        return Err(MultipartError::InvalidBoundary);
    }
    Ok(b)
}

/// What a [`ModelScan`] knows after a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// The model field (final: feeding more changes nothing).
    Found(String),
    /// Not known yet: feed more, or [`ModelScan::finish`] at the end of the body.
    NeedMore,
    /// The body cannot be read (final).
    Failed(MultipartError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Looking for the next delimiter: in the preamble, or through a part that is not `model`.
    Seek,
    /// Right after a delimiter: `--` closes the form, else padding and CRLF open a part.
    DelimiterLine,
    /// A part's header block, up to the empty line.
    Headers,
    /// The `model` part's content, up to the next delimiter.
    Value,
    Done(Result<String, MultipartError>),
}

/// The push parser (see the module doc).
#[derive(Debug, Clone)]
pub struct ModelScan {
    /// `CRLF--boundary`.
    delimiter: Vec<u8>,
    state: State,
    /// Bytes carried between chunks; bounded (see [`ModelScan::buffered`]).
    buf: Vec<u8>,
    parts: u32,
    seen_delimiter: bool,
}

impl ModelScan {
    /// A parser for a body of this `content-type`.
    pub fn new(content_type: &str) -> Result<ModelScan, MultipartError> {
        let b = boundary(content_type)?;
        let mut delimiter = Vec::with_capacity(b.len() + 4);
        delimiter.extend_from_slice(b"\r\n--");
        delimiter.extend_from_slice(&b);
        Ok(ModelScan {
            delimiter,
            state: State::Seek,
            // The first delimiter may open the body without a CRLF before it: pretend one.
            buf: b"\r\n".to_vec(),
            parts: 0,
            seen_delimiter: false,
        })
    }

    /// Bytes held between chunks (for tests of the memory bound).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Reads the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) -> Progress {
        let mut input = chunk;
        loop {
            let next = match &self.state {
                State::Done(r) => return progress(r),
                State::Seek => {
                    if !seek(&mut self.buf, &mut input, &self.delimiter) {
                        return Progress::NeedMore;
                    }
                    self.seen_delimiter = true;
                    State::DelimiterLine
                }
                State::DelimiterLine => match self.delimiter_line(&mut input) {
                    Some(s) => s,
                    None => return Progress::NeedMore,
                },
                State::Headers => {
                    // The CRLF that opened the block, the headers, the empty line.
                    let cap = MAX_PART_HEADER_BYTES + 6;
                    match fill_until(&mut self.buf, &mut input, b"\r\n\r\n", cap) {
                        Fill::More => return Progress::NeedMore,
                        Fill::Full => State::Done(Err(MultipartError::PartHeadersTooLarge)),
                        Fill::Found => {
                            self.parts += 1;
                            let is_model = names_model(self.buf.get(2..).unwrap_or(&[]));
                            self.buf.clear();
                            if is_model {
                                State::Value
                            } else if self.parts >= MAX_PARTS {
                                State::Done(Err(MultipartError::TooManyParts))
                            } else {
                                State::Seek
                            }
                        }
                    }
                }
                State::Value => {
                    let cap = MAX_MODEL_BYTES + self.delimiter.len();
                    match fill_until(&mut self.buf, &mut input, &self.delimiter, cap) {
                        Fill::More => return Progress::NeedMore,
                        Fill::Full => State::Done(Err(MultipartError::ModelTooLong)),
                        Fill::Found => State::Done(model_value(&self.buf)),
                    }
                }
            };
            if matches!(next, State::Done(_)) {
                self.buf = Vec::new();
            }
            self.state = next;
        }
    }

    /// The end of the body: the model, or why there is none.
    pub fn finish(&mut self) -> Result<String, MultipartError> {
        if let State::Done(r) = &self.state {
            return r.clone();
        }
        let r = Err(if self.seen_delimiter {
            MultipartError::Truncated
        } else {
            MultipartError::NoDelimiter
        });
        self.state = State::Done(r.clone());
        self.buf = Vec::new();
        r
    }

    /// After a delimiter: the next state, or `None` when more input is needed.
    fn delimiter_line(&mut self, input: &mut &[u8]) -> Option<State> {
        let cap = 2 + MAX_PADDING;
        let fill = fill_until(&mut self.buf, input, b"\r\n", cap);
        if self.buf.starts_with(b"--") {
            // The close delimiter: the form ended without a model.
            return Some(State::Done(Err(MultipartError::MissingModel)));
        }
        match fill {
            Fill::Found if self.buf.iter().all(|b| *b == b' ' || *b == b'\t') => {
                // The header block starts with the CRLF just read, so an empty block is
                // simply CRLF CRLF.
                self.buf.clear();
                self.buf.extend_from_slice(b"\r\n");
                Some(State::Headers)
            }
            Fill::Found | Fill::Full => Some(State::Done(Err(MultipartError::MalformedDelimiter))),
            Fill::More if self.buf.len() == 1 && self.buf.first() == Some(&b'-') => None,
            Fill::More if self.buf.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r')) => None,
            Fill::More => Some(State::Done(Err(MultipartError::MalformedDelimiter))),
        }
    }
}

fn progress(r: &Result<String, MultipartError>) -> Progress {
    match r {
        Ok(m) => Progress::Found(m.clone()),
        Err(e) => Progress::Failed(*e),
    }
}

/// Reads the model of a whole body (the convenience form of [`ModelScan`]).
pub fn read_model(content_type: &str, body: &[u8]) -> Result<String, MultipartError> {
    let mut scan = ModelScan::new(content_type)?;
    match scan.feed(body) {
        Progress::Found(m) => Ok(m),
        Progress::Failed(e) => Err(e),
        Progress::NeedMore => scan.finish(),
    }
}

fn model_value(bytes: &[u8]) -> Result<String, MultipartError> {
    if bytes.is_empty() {
        return Err(MultipartError::MissingModel);
    }
    if bytes.len() > MAX_MODEL_BYTES {
        return Err(MultipartError::ModelTooLong);
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| MultipartError::ModelNotUtf8)
}

/// Does this header block (lines separated by CRLF) say `Content-Disposition: form-data;
/// name="model"`?
fn names_model(block: &[u8]) -> bool {
    for line in split_crlf(block) {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = line.split_at(colon);
        if !trim(name).eq_ignore_ascii_case(b"content-disposition") {
            continue;
        }
        let (kind, params) = split_header_value(value.get(1..).unwrap_or(&[]));
        return kind.eq_ignore_ascii_case(b"form-data")
            && params
                .iter()
                .any(|(n, v)| n.eq_ignore_ascii_case(b"name") && v == b"model");
    }
    false
}

fn split_crlf(block: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(block);
    std::iter::from_fn(move || {
        let r = rest?;
        match find(r, b"\r\n") {
            Some(p) => {
                let (line, tail) = r.split_at(p);
                rest = tail.get(2..);
                Some(line)
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// A header parameter: its name as written, its value unquoted.
type Param<'a> = (&'a [u8], Vec<u8>);

/// Splits `type; a=b; c="d;e"` into the trimmed first item and the parameters (names as they
/// are, values unquoted with backslash escapes resolved). Bounded by the input's length.
fn split_header_value(value: &[u8]) -> (&[u8], Vec<Param<'_>>) {
    let first_end = value.iter().position(|b| *b == b';').unwrap_or(value.len());
    let (first, mut rest) = value.split_at(first_end);
    let mut params = Vec::new();
    while let Some((_, after)) = rest.split_first() {
        // `after` follows a ';'.
        let name_end = after
            .iter()
            .position(|b| *b == b'=' || *b == b';')
            .unwrap_or(after.len());
        let (name, tail) = after.split_at(name_end);
        let name = trim(name);
        if tail.first() != Some(&b'=') {
            rest = tail;
            continue;
        }
        let tail = trim_start(tail.get(1..).unwrap_or(&[]));
        let (v, remaining) = if tail.first() == Some(&b'"') {
            quoted(tail.get(1..).unwrap_or(&[]))
        } else {
            let end = tail.iter().position(|b| *b == b';').unwrap_or(tail.len());
            let (v, r) = tail.split_at(end);
            (trim(v).to_vec(), r)
        };
        if !name.is_empty() {
            params.push((name, v));
        }
        // Skip anything up to the next ';' (e.g. junk after a closing quote).
        let next = remaining
            .iter()
            .position(|b| *b == b';')
            .unwrap_or(remaining.len());
        rest = remaining.get(next..).unwrap_or(&[]);
    }
    (trim(first), params)
}

/// A quoted string's content (after the opening quote) and what follows its closing quote.
fn quoted(s: &[u8]) -> (Vec<u8>, &[u8]) {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(&b) = s.get(i) {
        match b {
            b'\\' => {
                if let Some(&n) = s.get(i + 1) {
                    out.push(n);
                }
                i += 2;
            }
            b'"' => return (out, s.get(i + 1..).unwrap_or(&[])),
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    (out, &[])
}

fn trim_start(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(s.len());
    s.get(start..).unwrap_or(&[])
}

fn trim(s: &[u8]) -> &[u8] {
    let s = trim_start(s);
    let end = s
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |p| p + 1);
    s.get(..end).unwrap_or(&[])
}

/// First position of `needle` in `hay`. The delimiter contains a single CR, at its start, so a
/// partial match can only begin at a CR of the haystack: the naive scan is linear here.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return Some(0);
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

enum Fill {
    /// The needle was found: the buffer holds what preceded it, the input is advanced past it.
    Found,
    /// The whole input was taken and the needle is not there yet.
    More,
    /// The buffer reached its cap without the needle.
    Full,
}

/// Appends input to `buf` (never beyond `cap` bytes) until `needle` appears in it.
fn fill_until(buf: &mut Vec<u8>, input: &mut &[u8], needle: &[u8], cap: usize) -> Fill {
    let old = buf.len();
    let take = cap.saturating_sub(old).min(input.len());
    let (taken, _) = input.split_at(take);
    buf.extend_from_slice(taken);
    let from = old.saturating_sub(needle.len().saturating_sub(1));
    match find(buf.get(from..).unwrap_or(&[]), needle) {
        Some(p) => {
            let at = from + p;
            // The buffer had no match before, so the needle ends in the new bytes.
            let consumed = (at + needle.len()).saturating_sub(old);
            *input = input.get(consumed..).unwrap_or(&[]);
            buf.truncate(at);
            Fill::Found
        }
        None if buf.len() >= cap => Fill::Full,
        None => {
            *input = input.get(take..).unwrap_or(&[]);
            Fill::More
        }
    }
}

/// Looks for `needle` across the carried bytes and `input` without copying `input`: only the
/// carry (shorter than the needle) plus as many input bytes are ever joined. Found: `input` is
/// advanced past the needle and the carry emptied. Not found: the carry keeps the last
/// `needle.len() - 1` bytes seen.
fn seek(carry: &mut Vec<u8>, input: &mut &[u8], needle: &[u8]) -> bool {
    let keep = needle.len().saturating_sub(1);
    if !carry.is_empty() {
        let mut bridge = Vec::with_capacity(carry.len() + keep);
        bridge.extend_from_slice(carry);
        bridge.extend_from_slice(input.get(..keep.min(input.len())).unwrap_or(&[]));
        if let Some(p) = find(&bridge, needle) {
            let consumed = (p + needle.len()).saturating_sub(carry.len());
            *input = input.get(consumed..).unwrap_or(&[]);
            carry.clear();
            return true;
        }
    }
    if let Some(p) = find(input, needle) {
        *input = input.get(p + needle.len()..).unwrap_or(&[]);
        carry.clear();
        return true;
    }
    if input.len() >= keep {
        carry.clear();
        carry.extend_from_slice(input.get(input.len() - keep..).unwrap_or(&[]));
    } else {
        carry.extend_from_slice(input);
        let excess = carry.len().saturating_sub(keep);
        carry.drain(..excess);
    }
    *input = &[];
    false
}

#[cfg(test)]
mod tests;
