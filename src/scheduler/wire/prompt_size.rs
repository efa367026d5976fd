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
//! the estimate afterwards (`Quota::settle`). The scan only stops at quotes (a byte search, the
//! cheap part of a per-request cost budget, tests/cost) and never copies the body.

/// What one inline media item (image, audio clip, file) counts for, in bytes.
pub const MEDIA_BYTES: u64 = 6_400;

/// Keys whose string values are encoded payloads, not text (with their closing quote).
const PAYLOAD_KEYS: [&[u8]; 3] = [b"data\"", b"file_data\"", b"b64_json\""];

/// The size of a JSON request body with each inline media string counted as [`MEDIA_BYTES`].
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

    /// The body's size with `media` replaced by `MEDIA_BYTES` each.
    fn expect(body: &str, media: &[&str]) -> u64 {
        let cut: usize = media.iter().map(|m| m.len()).sum();
        (body.len() - cut) as u64 + media.len() as u64 * MEDIA_BYTES
    }

    #[test]
    fn a_body_without_media_counts_its_bytes() {
        let body = r#"{"model":"m1","messages":[{"role":"user","content":"he said \"data\": \"data:x\""}],"type":"data"}"#;
        assert_eq!(prompt_bytes(body.as_bytes()), body.len() as u64);
        // A linked image is text.
        let linked = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}"#;
        assert_eq!(prompt_bytes(linked.as_bytes()), linked.len() as u64);
    }

    #[test]
    fn inline_media_counts_a_fixed_size_whatever_its_length() {
        let image = "A".repeat(2_000_000);
        let url = format!("data:image/png;base64,{image}");
        let openai = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
        );
        assert_eq!(prompt_bytes(openai.as_bytes()), expect(&openai, &[&url]));
        let audio = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data" : "{image}","format":"wav"}}}}]}}]}}"#
        );
        assert_eq!(prompt_bytes(audio.as_bytes()), expect(&audio, &[&image]));
        let anthropic = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}},{{"type":"image","source":{{"type":"base64","data":"{image}"}}}}]}}]}}"#
        );
        assert_eq!(
            prompt_bytes(anthropic.as_bytes()),
            expect(&anthropic, &[&image, &image])
        );
        let responses = format!(
            r#"{{"model":"m","input":[{{"role":"user","content":[{{"type":"input_file","file_data":"{url}"}}]}}]}}"#
        );
        assert_eq!(
            prompt_bytes(responses.as_bytes()),
            expect(&responses, &[&url])
        );
    }

    #[test]
    fn broken_bodies_count_at_most_their_bytes_and_media() {
        assert_eq!(prompt_bytes(b""), 0);
        assert_eq!(prompt_bytes(b"\""), 1);
        assert_eq!(prompt_bytes(b"not json at all"), 15);
        // An unterminated media string is media to the end.
        let cut = br#"{"url":"data:AAAA"#;
        assert_eq!(prompt_bytes(cut), (cut.len() - 9) as u64 + MEDIA_BYTES);
        // A payload key without a string value is not media.
        let num = br#"{"data": 5, "data":[1]}"#;
        assert_eq!(prompt_bytes(num), num.len() as u64);
    }
}
