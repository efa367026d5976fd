//! OpenAI chat-completion shapes: reading the request's prompt, writing completions, stream
//! chunks and errors.

use serde_json::{json, Value};

/// The prompt text the cache sees: for each message, `role`, `\n`, the content's text, `\n`.
/// Content may be a string or an array of parts (`{"type":"text","text":…}`); an inline media
/// part (`image_url`, `input_audio`, `image`) counts as [`MEDIA_TEXT_BYTES`] of text naming
/// a hash of the part, as hosted APIs charge an image a few hundred tokens whatever its encoded
/// size; anything else is taken as its compact JSON.
pub fn prompt_text(messages: &[Value]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
        out.push('\n');
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    let media = matches!(
                        p.get("type").and_then(Value::as_str),
                        Some("image_url" | "input_audio" | "image")
                    );
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => out.push_str(t),
                        None if media => out.push_str(&media_text(p)),
                        None => out.push_str(&p.to_string()),
                    }
                }
            }
            Some(Value::Null) | None => {}
            Some(other) => out.push_str(&other.to_string()),
        }
        out.push('\n');
    }
    out
}

/// Bytes of text an inline media part counts as (85 tokens, OpenAI's low-detail image).
pub const MEDIA_TEXT_BYTES: usize = 340;

/// `MEDIA_TEXT_BYTES` of text that differ between different media parts.
fn media_text(part: &Value) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    part.to_string().hash(&mut h);
    let mut t = format!("<media {:016x}>", h.finish());
    while t.len() < MEDIA_TEXT_BYTES {
        t.push('.');
    }
    t
}

/// Words of the mock answer: `"<name>"` then `w1 … w{n-1}`, one word per completion token.
pub fn completion_words(name: &str, n: u64) -> Vec<String> {
    (0..n)
        .map(|i| {
            if i == 0 {
                format!("[{name}]")
            } else {
                format!(" w{i}")
            }
        })
        .collect()
}

pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    pub fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

pub fn completion(
    id: &str,
    created: u64,
    model: &str,
    fingerprint: &str,
    text: &str,
    usage: &Usage,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "usage": usage.to_json(),
    })
}

pub fn chunk(id: &str, created: u64, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
    })
}

pub fn usage_chunk(id: &str, created: u64, model: &str, usage: &Usage) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_json(),
    })
}

/// An SSE event line for one JSON value.
pub fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The OpenAI error body for a status, with the conventional `type` and `code`.
pub fn error(status: u16, message: &str) -> Value {
    let (ty, code) = match status {
        400 => ("invalid_request_error", "invalid_request"),
        401 => ("invalid_request_error", "invalid_api_key"),
        403 => ("invalid_request_error", "permission_denied"),
        404 => ("invalid_request_error", "model_not_found"),
        429 => ("rate_limit_error", "rate_limit_exceeded"),
        s if s >= 500 => ("server_error", "server_error"),
        _ => ("invalid_request_error", "error"),
    };
    json!({"error": {"message": message, "type": ty, "param": null, "code": code}})
}
