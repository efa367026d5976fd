//! A request's prompt size for the quota estimate: its text, not its bytes.
//!
//! Why: quota-aware routing takes each request's estimated tokens off the key's remembered
//! count (`routing::quota`). Estimated from the body's bytes, one base64 image or audio clip
//! (megabytes, a few hundred tokens at the provider) took the count to zero, and every session
//! pinned to the key moved as if it were a certain 429 until the reset. So the estimate counts
//! the bytes of the body's JSON string values that are text, and a fixed [`MEDIA_BYTES`] for
//! each inline media item:
//! - a string value that starts with `data:` (an OpenAI `image_url.url`, a Responses
//!   `input_image.image_url` or `input_file.file_data` data URL) is media;
//! - a string value under a key that carries encoded payloads (`data`: OpenAI `input_audio`,
//!   Anthropic `source` blocks; `file_data`; `b64_json`) is media;
//! - any other string value counts its bytes (as written in the body, escapes included);
//!   object keys, numbers, booleans and the JSON punctuation do not count.
//!
//! Providers charge an image a few hundred to about 1 600 tokens whatever its encoded size
//! (OpenAI: 85 + 170 per 512-pixel tile; Anthropic: width × height / 750, at most ~1 600), so
//! `MEDIA_BYTES` is 1 600 tokens at 4 bytes a token. What the answer's `usage` reports corrects
//! the estimate afterwards (`Quota::settle`). One linear pass over the bytes, no allocation;
//! a body that is not JSON counts what its strings would.

/// What one inline media item (image, audio clip, file) counts for, in text bytes.
pub const MEDIA_BYTES: u64 = 6_400;

/// Keys whose string values are encoded payloads, not text.
const PAYLOAD_KEYS: [&[u8]; 3] = [b"data", b"file_data", b"b64_json"];

/// The text bytes of a JSON request body, each inline media item counted as [`MEDIA_BYTES`].
pub fn prompt_bytes(body: &[u8]) -> u64 {
    let mut total: u64 = 0;
    // The last key read (its raw bytes, between the quotes): what the next string value is.
    let mut key: &[u8] = &[];
    let mut i = 0;
    while let Some(&b) = body.get(i) {
        if b != b'"' {
            i += 1;
            continue;
        }
        let start = i + 1;
        let end = string_end(body, start);
        let s = body.get(start..end).unwrap_or_default();
        i = end + 1;
        // A key is followed by `:`.
        let next = body
            .get(i..)
            .unwrap_or_default()
            .iter()
            .find(|c| !c.is_ascii_whitespace());
        if next == Some(&b':') {
            key = s;
            continue;
        }
        let media = s.starts_with(b"data:") || PAYLOAD_KEYS.contains(&key);
        total = total.saturating_add(if media { MEDIA_BYTES } else { s.len() as u64 });
    }
    total
}

/// The index of the closing quote of the string whose contents start at `start` (or the
/// body's length if it never closes).
fn string_end(body: &[u8], start: usize) -> usize {
    let mut escaped = false;
    for (k, &c) in body.iter().enumerate().skip(start) {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, b'\\') => escaped = true,
            (false, b'"') => return k,
            _ => {}
        }
    }
    body.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn text_counts_its_bytes_keys_and_numbers_do_not() {
        let body =
            br#"{"model":"m1","messages":[{"role":"user","content":"hello"}],"max_tokens":100}"#;
        // "m1" + "user" + "hello"
        assert_eq!(prompt_bytes(body), 2 + 4 + 5);
        let spaced =
            br#"{ "model" : "m1" , "messages" : [ { "role" : "user" , "content" : "he\"llo" } ] }"#;
        assert_eq!(prompt_bytes(spaced), 2 + 4 + 7);
    }

    #[test]
    fn inline_media_counts_a_fixed_size_whatever_its_length() {
        let image = "A".repeat(2_000_000);
        let openai = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}}]}}]}}"#
        );
        let text =
            "m".len() + "user".len() + "text".len() + "what is this".len() + "image_url".len();
        assert_eq!(prompt_bytes(openai.as_bytes()), text as u64 + MEDIA_BYTES);
        let audio = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data":"{image}","format":"wav"}}}}]}}]}}"#
        );
        let text = "m".len() + "user".len() + "input_audio".len() + "wav".len();
        assert_eq!(prompt_bytes(audio.as_bytes()), text as u64 + MEDIA_BYTES);
        let anthropic = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}}]}}]}}"#
        );
        let text = "m".len() + "user".len() + "image".len() + "base64".len() + "image/png".len();
        assert_eq!(
            prompt_bytes(anthropic.as_bytes()),
            text as u64 + MEDIA_BYTES
        );
        // A URL that is not inline is text (a few bytes).
        let linked = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}"#;
        assert_eq!(prompt_bytes(linked), 1 + 4 + 9 + 15);
    }

    #[test]
    fn broken_bodies_count_what_is_there() {
        assert_eq!(prompt_bytes(b""), 0);
        assert_eq!(prompt_bytes(b"\""), 0);
        assert_eq!(prompt_bytes(br#"{"a":"xyz"#), 3);
        assert_eq!(prompt_bytes(br#"["\\","#), 2);
        assert_eq!(prompt_bytes(b"not json at all"), 0);
    }
}
