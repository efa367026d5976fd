//! Token usage read from answers as they pass, without holding them back.
//!
//! Why: users buy and budget LLM capacity in tokens, and the point of session affinity is the
//! prompt tokens an endpoint's KV cache does not have to compute again. Every OpenAI-style
//! answer says both in its `usage` object; counting them per endpoint and per affinity result
//! shows what the affinity saves.
//!
//! How: the answer streams through untouched; [`UsageScan`] keeps only its last
//! [`TAIL_BYTES`] bytes (a window over the concatenated chunks, so the chunking never changes
//! the result) and, when the answer has ended, reads the last `"usage": {…}` object in that
//! window. Every server we know writes it last: a JSON answer ends with it (OpenAI, vLLM,
//! SGLang, Anthropic), and a stream carries it in its final data event (OpenAI's
//! `stream_options.include_usage` chunk before `data: [DONE]`, Anthropic's `message_delta`
//! before `message_stop`).
//!
//! ```text
//! OpenAI    prompt = prompt_tokens   cached = prompt_tokens_details.cached_tokens
//!           completion = completion_tokens
//! Anthropic prompt = input_tokens + cache_creation_input_tokens + cache_read_input_tokens
//!           cached = cache_read_input_tokens   completion = output_tokens
//! llama.cpp as OpenAI, and where `usage` states no cached tokens: cached = timings.cache_n
//!           (its `timings` object, written after `usage`)
//! ```
//!
//! Not counted: an answer without a usage object (or whose usage is not in the last
//! [`TAIL_BYTES`]), a malformed one (a negative, fractional or non-numeric count), and a stream
//! that did not reach its end marker (`data: [DONE]`, or Anthropic's `message_stop` event):
//! a cut stream's usage, if any, is not its final one.

use serde::Deserialize;

/// The window kept from the end of an answer (4 KiB: an OpenAI usage chunk is ~350 bytes).
pub const TAIL_BYTES: usize = 4096;

/// The largest count taken from one answer, per field (2^32 − 1): a hostile upstream cannot
/// overflow a counter.
pub const MAX_TOKENS: u64 = u32::MAX as u64;

/// The tokens of one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt (input) tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the endpoint's prefix cache (`<= prompt_tokens`).
    pub cached_tokens: u64,
    /// Completion (output) tokens.
    pub completion_tokens: u64,
}

/// How the answer is framed (from its `content-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document.
    Json,
    /// Server-sent events (`text/event-stream`).
    EventStream,
}

impl Framing {
    /// `text/event-stream` (any case, parameters allowed) is a stream; anything else is read as
    /// one JSON document.
    pub fn from_content_type(value: Option<&[u8]>) -> Framing {
        let sse = value.is_some_and(|v| {
            v.len() >= 17
                && v.get(..17)
                    .is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
        });
        if sse {
            Framing::EventStream
        } else {
            Framing::Json
        }
    }
}

/// The scan of one answer: feed it every chunk (or any suffix of a chunk at least
/// [`TAIL_BYTES`] long), then [`UsageScan::finish`] it once the answer has ended.
#[derive(Debug, Clone)]
pub struct UsageScan {
    framing: Framing,
    /// The answer's last bytes: at least `min(total, TAIL_BYTES)`, at most `2 × TAIL_BYTES`.
    tail: Vec<u8>,
}

impl UsageScan {
    pub fn new(framing: Framing) -> Self {
        UsageScan {
            framing,
            tail: Vec::new(),
        }
    }

    /// The next chunk of the answer.
    pub fn feed(&mut self, chunk: &[u8]) {
        if chunk.len() >= TAIL_BYTES {
            self.tail.clear();
            self.make_room(TAIL_BYTES);
            self.tail
                .extend_from_slice(chunk.get(chunk.len() - TAIL_BYTES..).unwrap_or(chunk));
            return;
        }
        self.make_room(chunk.len());
        self.tail.extend_from_slice(chunk);
        if self.tail.len() > 2 * TAIL_BYTES {
            // Amortized: one move per TAIL_BYTES bytes fed.
            self.tail.drain(..self.tail.len() - TAIL_BYTES);
        }
    }

    /// Room for `more` bytes. The first chunk takes what it needs (most answers are one);
    /// from the second (the answer streams) the window's whole bound at once — before the
    /// drain in [`UsageScan::feed`] it holds less than `3 × TAIL_BYTES` — so the buffer is
    /// never moved again as it fills: each growth by doubling copied what it held (in the
    /// cost harness, 3 200 instructions over a streamed answer at 4 endpoints and 8 200 at 512,
    /// where the allocator could less often grow it in place).
    fn make_room(&mut self, more: usize) {
        let free = self.tail.capacity() - self.tail.len();
        if free < more && self.tail.capacity() > 0 {
            let bound = (3 * TAIL_BYTES).saturating_sub(self.tail.len());
            self.tail.reserve_exact(bound.max(more));
        }
    }

    /// Bytes held (bounded by `2 × TAIL_BYTES`).
    pub fn held(&self) -> usize {
        self.tail.len()
    }

    /// The answer has ended: its usage, if it reported one.
    pub fn finish(&self) -> Option<Usage> {
        let start = self.tail.len().saturating_sub(TAIL_BYTES);
        let window = self.tail.get(start..)?;
        if self.framing == Framing::EventStream && !stream_complete(window) {
            return None;
        }
        last_usage(window)
    }
}

/// Whether a stream's last event is its end marker: `data: [DONE]` (OpenAI) or the
/// `message_stop` event (Anthropic).
fn stream_complete(window: &[u8]) -> bool {
    let trimmed = window.trim_ascii_end();
    if trimmed.ends_with(b"[DONE]") {
        return true;
    }
    let last_event = match find_last(trimmed, b"\n\n") {
        Some(i) => trimmed.get(i..).unwrap_or(trimmed),
        None => trimmed,
    };
    find_last(last_event, b"\"message_stop\"").is_some()
}

/// The last well-formed `"usage": {…}` object in `window`.
fn last_usage(window: &[u8]) -> Option<Usage> {
    let mut end = window.len();
    while let Some(at) = find_last(window.get(..end)?, b"\"usage\"") {
        end = at;
        let rest = window.get(at + 7..)?.trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let rest = rest.trim_ascii_start();
        if !rest.starts_with(b"{") {
            // `"usage": null` in the chunks before the final one (vLLM): look further back.
            continue;
        }
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<RawUsage>();
        return match values.next() {
            Some(Ok(raw)) => raw.usage().map(|u| match raw.states_cached() {
                true => u,
                // llama.cpp: the prompt cache's hit is in `timings`, after `usage`.
                false => Usage {
                    cached_tokens: cache_n(rest).unwrap_or(0).min(u.prompt_tokens),
                    ..u
                },
            }),
            _ => None,
        };
    }
    None
}

/// llama.cpp's `"timings": {"cache_n": N, …}` in `after` (the bytes from the `usage` object on).
fn cache_n(after: &[u8]) -> Option<u64> {
    #[derive(Deserialize)]
    struct Timings {
        cache_n: Option<u64>,
    }
    let at = find_last(after, b"\"timings\"")?;
    let rest = after.get(at + 9..)?.trim_ascii_start().strip_prefix(b":")?;
    let mut values =
        serde_json::Deserializer::from_slice(rest.trim_ascii_start()).into_iter::<Timings>();
    let n = values.next()?.ok()?.cache_n?;
    Some(n.min(MAX_TOKENS))
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| hay.get(i..i + needle.len()) == Some(needle))
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// The fields read; anything else in the object is ignored.
#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

impl RawUsage {
    /// Whether the object itself states the cached tokens (OpenAI's details, Anthropic's
    /// cache read).
    fn states_cached(&self) -> bool {
        self.prompt_tokens_details
            .as_ref()
            .is_some_and(|d| d.cached_tokens.is_some())
            || self.cache_read_input_tokens.is_some()
    }

    fn usage(&self) -> Option<Usage> {
        let cap = |v: Option<u64>| v.unwrap_or(0).min(MAX_TOKENS);
        let u = if self.prompt_tokens.is_some() || self.completion_tokens.is_some() {
            Usage {
                prompt_tokens: cap(self.prompt_tokens),
                cached_tokens: cap(self
                    .prompt_tokens_details
                    .as_ref()
                    .and_then(|d| d.cached_tokens)),
                completion_tokens: cap(self.completion_tokens),
            }
        } else if self.input_tokens.is_some() || self.output_tokens.is_some() {
            let read = cap(self.cache_read_input_tokens);
            Usage {
                prompt_tokens: (cap(self.input_tokens)
                    + cap(self.cache_creation_input_tokens)
                    + read)
                    .min(MAX_TOKENS),
                cached_tokens: read,
                completion_tokens: cap(self.output_tokens),
            }
        } else {
            return None;
        };
        Some(Usage {
            cached_tokens: u.cached_tokens.min(u.prompt_tokens),
            ..u
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    // Property tests run natively only (proptest is not a wasm32 dev-dependency).
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn scan(framing: Framing, body: &[u8]) -> Option<Usage> {
        let mut s = UsageScan::new(framing);
        s.feed(body);
        s.finish()
    }

    fn usage(p: u64, c: u64, o: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: p,
            cached_tokens: c,
            completion_tokens: o,
        })
    }

    const OPENAI_JSON: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\": 9}"}}],"usage":{"prompt_tokens":120,"completion_tokens":16,"total_tokens":136,"prompt_tokens_details":{"cached_tokens":96}},"system_fingerprint":null}"#;

    const OPENAI_SSE: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n\
data: [DONE]\n\n";

    const ANTHROPIC_SSE: &[u8] = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":1}}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":10,\"cache_creation_input_tokens\":5,\"cache_read_input_tokens\":2000,\"output_tokens\":42}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

    /// llama.cpp states its prompt-cache hit in `timings.cache_n`, after `usage`; a `usage`
    /// that states cached tokens itself wins.
    #[test]
    fn llama_cpp_timings_cache_n() {
        let plain = br#"{"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":300,"total_tokens":305},"id":"x","timings":{"cache_n":256,"prompt_n":44}}"#;
        assert_eq!(scan(Framing::Json, plain), usage(300, 256, 5));
        let streamed = b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":5,\"prompt_tokens\":300},\"timings\":{\"cache_n\":299}}\n\ndata: [DONE]\n\n";
        assert_eq!(scan(Framing::EventStream, streamed), usage(300, 299, 5));
        let stated = br#"{"usage":{"completion_tokens":5,"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens":16}},"timings":{"cache_n":256}}"#;
        assert_eq!(scan(Framing::Json, stated), usage(300, 16, 5));
        let above =
            br#"{"usage":{"completion_tokens":5,"prompt_tokens":300},"timings":{"cache_n":9999}}"#;
        assert_eq!(scan(Framing::Json, above), usage(300, 300, 5));
        let garbage =
            br#"{"usage":{"completion_tokens":5,"prompt_tokens":300},"timings":{"cache_n":-1}}"#;
        assert_eq!(scan(Framing::Json, garbage), usage(300, 0, 5));
    }

    #[test]
    fn a_stream_buffer_is_sized_once_from_its_second_chunk() {
        // One chunk (most answers): what it needs, not the window's bound.
        let mut one = UsageScan::new(Framing::Json);
        one.feed(OPENAI_JSON);
        assert!(one.tail.capacity() < TAIL_BYTES);
        // A stream of small events: from the second, the buffer never grows (or moves) again,
        // through drains and a chunk larger than the window; the result is the same.
        let mut s = UsageScan::new(Framing::EventStream);
        let event = b"data: {\"choices\":[{\"delta\":{\"content\":\"token \"}}]}\n\n";
        s.feed(event);
        s.feed(event);
        let capacity = s.tail.capacity();
        assert!(
            capacity >= 3 * TAIL_BYTES - 1,
            "sized for the window: {capacity}"
        );
        for i in 0..2_000 {
            s.feed(event);
            if i == 1_000 {
                s.feed(&[b' '; 3 * TAIL_BYTES]);
            }
            assert_eq!(s.tail.capacity(), capacity, "grew at event {i}");
        }
        s.feed(OPENAI_SSE);
        assert_eq!(s.tail.capacity(), capacity);
        assert_eq!(s.finish(), usage(50, 32, 3));
    }

    #[test]
    fn openai_json_answer() {
        assert_eq!(scan(Framing::Json, OPENAI_JSON), usage(120, 96, 16));
    }

    #[test]
    fn openai_stream_final_event() {
        assert_eq!(scan(Framing::EventStream, OPENAI_SSE), usage(50, 32, 3));
    }

    #[test]
    fn anthropic_json_and_stream() {
        let json = br#"{"type":"message","content":[{"type":"tool_use","input":{"usage":{"input_tokens":7}}}],"usage":{"input_tokens":3,"cache_read_input_tokens":100,"output_tokens":9}}"#;
        assert_eq!(scan(Framing::Json, json), usage(103, 100, 9));
        assert_eq!(
            scan(Framing::EventStream, ANTHROPIC_SSE),
            usage(2015, 2000, 42)
        );
    }

    #[test]
    fn cut_stream_is_not_counted() {
        // Cut after the usage event but before `[DONE]`, and cut before the usage event.
        let before_done = &OPENAI_SSE[..OPENAI_SSE.len() - b"data: [DONE]\n\n".len()];
        assert_eq!(scan(Framing::EventStream, before_done), None);
        assert_eq!(scan(Framing::EventStream, &OPENAI_SSE[..60]), None);
        let before_stop = &ANTHROPIC_SSE[..ANTHROPIC_SSE.len() - 20];
        assert_eq!(scan(Framing::EventStream, before_stop), None);
    }

    #[test]
    fn answers_without_usage_are_not_counted() {
        assert_eq!(scan(Framing::Json, br#"{"choices":[]}"#), None);
        assert_eq!(scan(Framing::Json, br#"{"usage":null}"#), None);
        assert_eq!(
            scan(Framing::Json, br#"{"usage":{"total_tokens":5}}"#),
            None
        );
        assert_eq!(
            scan(Framing::Json, br#"{"usage":{"prompt_tokens":-5}}"#),
            None
        );
        assert_eq!(
            scan(Framing::Json, br#"{"usage":{"prompt_tokens":1.5}}"#),
            None
        );
        assert_eq!(scan(Framing::Json, b""), None);
        let sse = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(scan(Framing::EventStream, sse), None);
    }

    #[test]
    fn hostile_counts_are_capped() {
        let big = br#"{"usage":{"prompt_tokens":18446744073709551615,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":18446744073709551615}}}"#;
        assert_eq!(scan(Framing::Json, big), usage(MAX_TOKENS, MAX_TOKENS, 1));
        // Cached above prompt: clamped to the prompt.
        let odd = br#"{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":99}}}"#;
        assert_eq!(scan(Framing::Json, odd), usage(10, 10, 0));
    }

    #[test]
    fn usage_beyond_the_window_is_not_seen() {
        let mut body =
            br#"{"usage":{"prompt_tokens":5,"completion_tokens":1},"x_padding":""#.to_vec();
        body.extend(std::iter::repeat_n(b'x', TAIL_BYTES));
        body.extend_from_slice(b"\"}");
        assert_eq!(scan(Framing::Json, &body), None);
        // Padding before the usage does not matter.
        let mut padded = br#"{"x_padding":""#.to_vec();
        padded.extend(std::iter::repeat_n(b'x', 10 * TAIL_BYTES));
        padded.extend_from_slice(br#"","usage":{"prompt_tokens":5,"completion_tokens":1}}"#);
        assert_eq!(scan(Framing::Json, &padded), usage(5, 0, 1));
    }

    #[test]
    fn framing_from_content_type() {
        let f = |v: &[u8]| Framing::from_content_type(Some(v));
        assert_eq!(f(b"text/event-stream"), Framing::EventStream);
        assert_eq!(f(b"Text/Event-Stream; charset=utf-8"), Framing::EventStream);
        assert_eq!(f(b"application/json"), Framing::Json);
        assert_eq!(Framing::from_content_type(None), Framing::Json);
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn split(body: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        cuts.sort_unstable();
        let mut out = Vec::new();
        let mut from = 0;
        for c in cuts {
            out.push(body[from..c].to_vec());
            from = c;
        }
        out.push(body[from..].to_vec());
        out
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn answers() -> impl Strategy<Value = (Framing, Vec<u8>)> {
        let pad = (0usize..3 * TAIL_BYTES).prop_map(|n| vec![b' '; n]);
        prop_oneof![
            pad.clone().prop_map(|p| {
                let mut b = OPENAI_JSON.to_vec();
                b.splice(1..1, p.iter().copied().chain(*b"\"a\":1,"));
                (Framing::Json, b)
            }),
            pad.clone().prop_map(|p| {
                let mut b = p;
                b.extend_from_slice(OPENAI_SSE);
                (Framing::EventStream, b)
            }),
            pad.prop_map(|p| {
                let mut b = p;
                b.extend_from_slice(ANTHROPIC_SSE);
                (Framing::EventStream, b)
            }),
        ]
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn chunking_never_changes_the_result(
            (framing, body) in answers(),
            cuts in proptest::collection::vec(any::<usize>(), 0..40),
        ) {
            let whole = scan(framing, &body);
            prop_assert!(whole.is_some());
            let mut s = UsageScan::new(framing);
            for chunk in split(&body, &cuts) {
                s.feed(&chunk);
                prop_assert!(s.held() <= 2 * TAIL_BYTES);
            }
            prop_assert_eq!(s.finish(), whole);
        }

        #[test]
        fn hostile_input_never_panics_and_stays_bounded(
            chunks in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::sample::select(b"\"{}:\\\n []usage_tokens0123456789-.,\xff".to_vec()),
                    0..300,
                ),
                0..40,
            ),
            sse in any::<bool>(),
            keyed in any::<bool>(),
        ) {
            let framing = if sse { Framing::EventStream } else { Framing::Json };
            let mut s = UsageScan::new(framing);
            for c in &chunks {
                if keyed {
                    s.feed(b"\"usage\": {\"prompt_tokens\": ");
                }
                s.feed(c);
                prop_assert!(s.held() <= 2 * TAIL_BYTES);
            }
            if let Some(u) = s.finish() {
                prop_assert!(u.cached_tokens <= u.prompt_tokens);
                prop_assert!(u.prompt_tokens <= MAX_TOKENS && u.completion_tokens <= MAX_TOKENS);
            }
        }
    }
}
