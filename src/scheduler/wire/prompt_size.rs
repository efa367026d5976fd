//! A request's prompt size for the quota estimate: its bytes without its inline media.
//!
//! Why: quota-aware routing takes each request's estimated tokens off the key's remembered
//! count (`routing::quota`). Estimated from the body's bytes, one base64 image or audio clip
//! (megabytes, a few hundred tokens at the provider) took the count to zero, and every session
//! pinned to the key moved as if it were a certain 429 until the reset. So the size is the
//! body's bytes with each inline media string replaced by a fixed [`MEDIA_BYTES`]:
//! - a JSON string that starts with `data:` (an OpenAI `image_url.url`, a Responses
//!   `input_image.image_url` or `input_file.file_data` data URL) is media;
//! - the string value of a key that carries encoded payloads (`data`: OpenAI `input_audio`,
//!   Anthropic `source` blocks; `file_data`; `b64_json`) is media;
//! - everything else counts its bytes, as before (text, keys and punctuation: a body without
//!   media is estimated exactly as it was).
//!
//! Providers charge an image a few hundred to about 1 600 tokens whatever its encoded size
//! (OpenAI: 85 + 170 per 512-pixel tile; Anthropic: width × height / 750, at most ~1 600), so
//! `MEDIA_BYTES` is 1 600 tokens at 4 bytes a token. What the answer's `usage` reports corrects
//! the estimate afterwards (`Quota::settle`).
//!
//! [`scan`] finds the size in the same pass that finds the body's nesting depth (which the
//! request parser bounds, `request::MAX_DEPTH`): both only need where each string starts and
//! ends, and a 32 KB prompt is one long string that a pass steps over eight bytes at a time.
//! Two passes cost 7 instructions a byte of it (tests/cost `body_32k`), one about 3. It never
//! copies the body.

/// What one inline media item (image, audio clip, file) counts for, in bytes.
pub const MEDIA_BYTES: u64 = 6_400;

/// Keys whose string values are encoded payloads, not text (with their closing quote).
const PAYLOAD_KEYS: [&[u8]; 3] = [b"data\"", b"file_data\"", b"b64_json\""];

/// What one pass over a JSON request body finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyScan {
    /// The deepest `[` / `{` nesting outside strings.
    pub depth: usize,
    /// The body's size with each inline media string counted as [`MEDIA_BYTES`].
    pub prompt_bytes: u64,
}

/// One pass over `body`: its nesting depth and its prompt size (see the module's doc). A
/// string is stepped over in words of eight bytes, two a step, while they hold no quote or
/// backslash; an unterminated one runs to the end (media to the end, if it is media).
pub fn scan(body: &[u8]) -> BodyScan {
    let (mut depth, mut max) = (0usize, 0usize);
    let (mut media, mut media_bytes) = (0u64, 0u64);
    // The string about to start is the value of a payload key (`"data": "…"`).
    let mut payload_value = false;
    let mut at = 0usize;
    while let Some(&b) = body.get(at) {
        at += 1;
        match b {
            b'"' => {
                let rest = body.get(at..).unwrap_or_default();
                let is_media = std::mem::take(&mut payload_value) || rest.starts_with(b"data:");
                let key = !is_media && PAYLOAD_KEYS.iter().any(|k| rest.starts_with(k));
                let len = string_end(rest);
                if is_media {
                    media += 1;
                    media_bytes = media_bytes.saturating_add(len.unwrap_or(rest.len()) as u64);
                }
                let Some(len) = len else { break };
                at += len + 1;
                if key {
                    let colon = skip_ws(body, at);
                    if body.get(colon) == Some(&b':') {
                        let value = skip_ws(body, colon + 1);
                        if body.get(value) == Some(&b'"') {
                            payload_value = true;
                            at = value;
                        }
                    }
                }
            }
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    BodyScan {
        depth: max,
        prompt_bytes: (body.len() as u64)
            .saturating_sub(media_bytes)
            .saturating_add(media.saturating_mul(MEDIA_BYTES)),
    }
}

/// Where the string whose contents start `rest` ends: the index of its closing quote, `None`
/// if it has none. Whole words without a quote or backslash are stepped over, then bytes to
/// the next of either; a backslash skips the byte after it.
fn string_end(rest: &[u8]) -> Option<usize> {
    let mut at = 0usize;
    loop {
        let tail = rest.get(at..)?;
        let run = string_run(tail);
        let p = tail
            .get(run..)?
            .iter()
            .position(|&c| c == b'"' || c == b'\\')?;
        at += run + p;
        if rest.get(at) == Some(&b'"') {
            return Some(at);
        }
        at += 2;
    }
}

/// How many leading bytes of `text`, in whole words of eight, hold neither a quote nor a
/// backslash: two words a step while both are clear, then one.
fn string_run(text: &[u8]) -> usize {
    let mut run = 0;
    for pair in text.chunks_exact(16) {
        let (a, b) = pair.split_at(8);
        if special(word(a)) | special(word(b)) != 0 {
            break;
        }
        run += 16;
    }
    if text
        .get(run..run + 8)
        .is_some_and(|w| special(word(w)) == 0)
    {
        run += 8;
    }
    run
}

/// The first eight bytes of `bytes` as a little-endian word (0 if it is shorter).
fn word(bytes: &[u8]) -> u64 {
    bytes
        .first_chunk::<8>()
        .map_or(0, |w| u64::from_le_bytes(*w))
}

/// Nonzero exactly when some byte of `w` is a quote or a backslash: the exact zero-byte test
/// (`x - 0x01… & !x & 0x80…`, nonzero exactly when some byte of `x` is zero) of `w` XORed with
/// each pattern.
fn special(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let (q, s) = (w ^ (ONES * b'"' as u64), w ^ (ONES * b'\\' as u64));
    ((q.wrapping_sub(ONES) & !q) | (s.wrapping_sub(ONES) & !s)) & (ONES << 7)
}

/// The size of a JSON request body with each inline media string counted as [`MEDIA_BYTES`]:
/// the scan [`scan`] replaced (quote by quote, with a word search for the next quote), kept as
/// the reference its tests compare against.
#[cfg(test)]
pub fn prompt_bytes(body: &[u8]) -> u64 {
    let (mut media, mut media_bytes) = (0u64, 0u64);
    let mut i = 0;
    while let Some(off) = body.get(i..).and_then(find_quote) {
        let q = i + off;
        i = q + 1;
        if escaped(body, q) {
            continue;
        }
        let rest = body.get(q + 1..).unwrap_or_default();
        let value = if rest.starts_with(b"data:") {
            Some(q + 1)
        } else if let Some(k) = PAYLOAD_KEYS.iter().find(|k| rest.starts_with(k)) {
            // The key's value, if it is a string: `"data" : "…"`.
            let after = skip_ws(body, q + 1 + k.len());
            match body.get(after) {
                Some(b':') => {
                    let v = skip_ws(body, after + 1);
                    (body.get(v) == Some(&b'"')).then_some(v + 1)
                }
                _ => None,
            }
        } else {
            None
        };
        if let Some(start) = value {
            let len = string_len(body, start);
            media += 1;
            media_bytes = media_bytes.saturating_add(len as u64);
            i = start + len + 1;
        }
    }
    (body.len() as u64)
        .saturating_sub(media_bytes)
        .saturating_add(media.saturating_mul(MEDIA_BYTES))
}

/// The first `"` in `hay`. Eight bytes a step (the zero-byte test of a word XORed with the
/// quote pattern): a 32 KiB prompt is one long string, and a byte-at-a-time search cost about
/// 26 wasm instructions a byte there (tests/cost `body_32k`), more than parsing the JSON.
#[cfg(test)]
fn find_quote(hay: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    const QUOTES: u64 = ONES * b'"' as u64;
    let mut chunks = hay.chunks_exact(8);
    let mut skipped = 0;
    for chunk in &mut chunks {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let x = u64::from_le_bytes(bytes) ^ QUOTES;
        if x.wrapping_sub(ONES) & !x & HIGHS != 0 {
            break;
        }
        skipped += 8;
    }
    let rest = hay.get(skipped..).unwrap_or_default();
    rest.iter().position(|&b| b == b'"').map(|p| skipped + p)
}

/// Whether the quote at `q` is escaped (preceded by an odd number of backslashes).
#[cfg(test)]
fn escaped(body: &[u8], q: usize) -> bool {
    let before = body.get(..q).unwrap_or_default();
    before.iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

fn skip_ws(body: &[u8], from: usize) -> usize {
    from + body
        .get(from..)
        .unwrap_or_default()
        .iter()
        .take_while(|b| b.is_ascii_whitespace())
        .count()
}

/// Bytes of the string whose contents start at `start`, up to its closing quote (or the end).
#[cfg(test)]
fn string_len(body: &[u8], start: usize) -> usize {
    let mut escaped = false;
    let rest = body.get(start..).unwrap_or_default();
    for (k, &c) in rest.iter().enumerate() {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, b'\\') => escaped = true,
            (false, b'"') => return k,
            _ => {}
        }
    }
    rest.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_word_search_finds_the_first_quote_wherever_it_is() {
        for len in 0..40 {
            for at in 0..=len {
                let mut hay = vec![b'x'; len];
                if let Some(b) = hay.get_mut(at) {
                    *b = b'"';
                }
                let want = (at < len).then_some(at);
                assert_eq!(find_quote(&hay), want, "len {len}, quote at {at}");
                // A second quote later changes nothing; bytes that differ from `"` by one bit
                // (`#`, `\x22 ^ 0x80`) are not quotes.
                hay.extend_from_slice(b"#\xa2\"");
                assert_eq!(
                    find_quote(&hay).unwrap_or(usize::MAX).min(len),
                    want.unwrap_or(len)
                );
            }
        }
    }

    /// The one-pass scan's size, checked against the reference scan it replaced.
    fn both(body: &[u8]) -> u64 {
        let one = scan(body).prompt_bytes;
        assert_eq!(one, prompt_bytes(body), "{}", String::from_utf8_lossy(body));
        one
    }

    #[cfg(not(target_arch = "wasm32"))]
    /// A JSON value of strings (text, escapes, `data:` URLs, non-ASCII), payload keys with
    /// string and other values, numbers, arrays and objects, with optional whitespace.
    fn json_value() -> impl Strategy<Value = String> {
        let text = prop::sample::select(vec![
            "",
            "hi",
            "data:image/png;base64,AAAA",
            "data",
            "data:",
            "dat",
            "a \\\" quote",
            "back\\\\slash",
            "\\u00e9t\\u00e9",
            "caf\u{e9} \u{4e2d}\u{6587}",
            "lorem ipsum dolor sit amet, consectetur adipiscing elit",
            "}{][,:",
        ])
        .prop_flat_map(|t| (Just(t), 0usize..40))
        .prop_map(|(t, n)| format!("\"{}\"", t.repeat(n.max(1))));
        let ws = prop::sample::select(vec!["", " ", "\n  "]);
        let leaf = prop_oneof![
            text.clone(),
            Just("5".to_string()),
            Just("true".to_string())
        ];
        leaf.prop_recursive(4, 64, 6, move |inner| {
            let key = prop_oneof![
                text.clone(),
                prop::sample::select(vec!["\"data\"", "\"file_data\"", "\"b64_json\"", "\"url\""])
                    .prop_map(str::to_string),
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key, ws.clone(), inner), 0..5).prop_map(|v| {
                    let fields: Vec<String> = v
                        .into_iter()
                        .map(|(k, w, x)| format!("{k}{w}:{w}{x}"))
                        .collect();
                    format!("{{{}}}", fields.join(","))
                }),
            ]
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        /// On any JSON the one-pass scan finds the size the reference scan finds.
        #[test]
        fn the_one_pass_scan_sizes_as_the_reference(body in json_value()) {
            prop_assert!(serde_json::from_str::<serde_json::Value>(&body).is_ok(), "{}", body);
            prop_assert_eq!(scan(body.as_bytes()).prompt_bytes, prompt_bytes(body.as_bytes()));
        }
    }

    /// The body's size with `media` replaced by `MEDIA_BYTES` each.
    fn expect(body: &str, media: &[&str]) -> u64 {
        let cut: usize = media.iter().map(|m| m.len()).sum();
        (body.len() - cut) as u64 + media.len() as u64 * MEDIA_BYTES
    }

    #[test]
    fn a_body_without_media_counts_its_bytes() {
        let body = r#"{"model":"m1","messages":[{"role":"user","content":"he said \"data\": \"data:x\""}],"type":"data"}"#;
        assert_eq!(both(body.as_bytes()), body.len() as u64);
        // A linked image is text.
        let linked = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}"#;
        assert_eq!(both(linked.as_bytes()), linked.len() as u64);
    }

    #[test]
    fn inline_media_counts_a_fixed_size_whatever_its_length() {
        let image = "A".repeat(2_000_000);
        let url = format!("data:image/png;base64,{image}");
        let openai = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
        );
        assert_eq!(both(openai.as_bytes()), expect(&openai, &[&url]));
        let audio = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data" : "{image}","format":"wav"}}}}]}}]}}"#
        );
        assert_eq!(both(audio.as_bytes()), expect(&audio, &[&image]));
        let anthropic = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}},{{"type":"image","source":{{"type":"base64","data":"{image}"}}}}]}}]}}"#
        );
        assert_eq!(
            both(anthropic.as_bytes()),
            expect(&anthropic, &[&image, &image])
        );
        let responses = format!(
            r#"{{"model":"m","input":[{{"role":"user","content":[{{"type":"input_file","file_data":"{url}"}}]}}]}}"#
        );
        assert_eq!(both(responses.as_bytes()), expect(&responses, &[&url]));
    }

    #[test]
    fn broken_bodies_count_at_most_their_bytes_and_media() {
        assert_eq!(both(b""), 0);
        assert_eq!(both(b"\""), 1);
        assert_eq!(both(b"not json at all"), 15);
        // An unterminated media string is media to the end.
        let cut = br#"{"url":"data:AAAA"#;
        assert_eq!(both(cut), (cut.len() - 9) as u64 + MEDIA_BYTES);
        // A payload key without a string value is not media.
        let num = br#"{"data": 5, "data":[1]}"#;
        assert_eq!(both(num), num.len() as u64);
    }
}
