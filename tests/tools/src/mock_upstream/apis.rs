//! The OpenAI-compatible APIs beyond chat completions that vLLM-like servers offer, in the
//! shapes the official SDKs parse: embeddings, audio transcriptions / translations (multipart
//! forms), the Responses API with stored state, and Anthropic Messages.
//!
//! Why: the filter treats each API differently (JSON, multipart, state held by one endpoint),
//! and the SDK tests need an upstream that answers each like the real thing, including the
//! Responses API's `404 previous_response_not_found` when a follow-up reaches an endpoint that
//! did not store its predecessor.
//!
//! The multipart parser here is deliberately naive and independent of the filter's
//! (`src/scheduler/multipart.rs`): the tests compare what each of them read.

use std::collections::{HashMap, VecDeque};

use serde_json::{json, Value};

use super::openai;

/// The APIs the mock answers with a body of its own (chat completions aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Embeddings,
    Transcriptions,
    Translations,
    Responses,
    Messages,
}

impl Api {
    pub fn from_path(path: &str) -> Option<Api> {
        Some(match path {
            "/v1/chat/completions" => Api::Chat,
            "/v1/embeddings" => Api::Embeddings,
            "/v1/audio/transcriptions" => Api::Transcriptions,
            "/v1/audio/translations" => Api::Translations,
            "/v1/responses" => Api::Responses,
            "/v1/messages" => Api::Messages,
            _ => return None,
        })
    }
}

/// A `multipart/form-data` body: text fields and the size of file parts.
#[derive(Debug, Default)]
pub struct Form {
    pub fields: HashMap<String, String>,
    pub file_bytes: usize,
}

/// Parses a form by splitting on `--boundary` (good enough for well-formed test bodies).
pub fn parse_form(content_type: &str, body: &[u8]) -> Option<Form> {
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| {
            p.strip_prefix("boundary=")
                .or_else(|| p.strip_prefix("BOUNDARY="))
        })?
        .trim_matches('"');
    let delimiter = format!("--{boundary}");
    let mut form = Form::default();
    for part in split(body, delimiter.as_bytes()).into_iter().skip(1) {
        if part.starts_with(b"--") {
            break;
        }
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        let Some(head_end) = find(part, b"\r\n\r\n") else {
            continue;
        };
        let head =
            String::from_utf8_lossy(part.get(..head_end).unwrap_or_default()).to_ascii_lowercase();
        let content = part.get(head_end + 4..).unwrap_or_default();
        let content = content.strip_suffix(b"\r\n").unwrap_or(content);
        let Some(name) = head
            .split(';')
            .map(str::trim)
            .find_map(|p| p.strip_prefix("name="))
        else {
            continue;
        };
        let name = name
            .split(['\r', '\n'])
            .next()
            .unwrap_or("")
            .trim_matches('"');
        if head.contains("filename=") {
            form.file_bytes += content.len();
        } else {
            form.fields.insert(
                name.to_string(),
                String::from_utf8_lossy(content).into_owned(),
            );
        }
    }
    Some(form)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

fn split<'a>(mut hay: &'a [u8], needle: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    while let Some(p) = find(hay, needle) {
        out.push(hay.get(..p).unwrap_or_default());
        hay = hay.get(p + needle.len()..).unwrap_or_default();
    }
    out.push(hay);
    out
}

/// `POST /v1/audio/transcriptions` and `/translations`: the answer names the model received and
/// the file's size. `(content-type, body)` per `response_format`.
pub fn transcription(api: Api, name: &str, model: &str, form: &Form) -> (&'static str, String) {
    let task = if api == Api::Translations {
        "translated"
    } else {
        "transcribed"
    };
    let text = format!("[{name}] {task} {} bytes with {model}", form.file_bytes);
    match form.fields.get("response_format").map(String::as_str) {
        Some("text") | Some("srt") | Some("vtt") => ("text/plain", text),
        Some("verbose_json") => (
            "application/json",
            json!({"task": if api == Api::Translations { "translate" } else { "transcribe" },
                   "language": "english", "duration": 1.0, "text": text, "segments": []})
            .to_string(),
        ),
        _ => ("application/json", json!({ "text": text }).to_string()),
    }
}

/// The texts of an embeddings `input` (a string, strings, or token arrays).
pub fn embedding_inputs(input: Option<&Value>) -> Option<Vec<String>> {
    match input? {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Some(vec![Value::Array(items.clone()).to_string()])
        }
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => Some(s.clone()),
                Value::Array(_) => Some(i.to_string()),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// `POST /v1/embeddings`: deterministic vectors (the same text always gets the same vector),
/// as floats or, with `encoding_format: "base64"` (the Python SDK's default), little-endian
/// float32 in base64.
pub fn embeddings(req: &Value, model: &str, texts: &[String], prompt_tokens: u64) -> Value {
    let dims = req
        .get("dimensions")
        .and_then(Value::as_u64)
        .unwrap_or(8)
        .clamp(1, 4096) as usize;
    let base64 = req.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let data: Vec<Value> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let v = vector(t, dims);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                Value::String(base64_encode(&bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

fn vector(text: &str, dims: usize) -> Vec<f32> {
    // FNV-1a, then a xorshift stream: stable across runs and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    (0..dims)
        .map(|_| {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk.first().copied().unwrap_or(0),
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].iter().enumerate() {
            if i <= chunk.len() {
                let c = ALPHABET.get(((n >> shift) & 63) as usize).copied();
                out.push(char::from(c.unwrap_or(b'=')));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A stored response: what a follow-up continues from.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The prompt text of the whole conversation so far, the answer included.
    pub transcript: String,
    /// Turns in the conversation (1 for a response without a predecessor).
    pub turns: u64,
}

/// Responses kept for `previous_response_id` (`store: true`, the default); the oldest go
/// first beyond the capacity.
pub struct ResponseStore {
    map: HashMap<String, Stored>,
    order: VecDeque<String>,
    capacity: usize,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        ResponseStore {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    pub fn get(&self, id: &str) -> Option<&Stored> {
        self.map.get(id)
    }

    pub fn insert(&mut self, id: String, stored: Stored) {
        while self.order.len() >= self.capacity.max(1) {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
        self.order.push_back(id.clone());
        self.map.insert(id, stored);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// OpenAI's answer to a follow-up whose predecessor this server does not hold.
pub fn previous_not_found(id: &str) -> Value {
    json!({"error": {
        "message": format!("Previous response with id '{id}' not found."),
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }})
}

/// The prompt text a Responses request adds: its instructions and input items.
pub fn responses_prompt(req: &Value) -> Option<String> {
    let mut out = String::new();
    if let Some(i) = req.get("instructions").and_then(Value::as_str) {
        out.push_str("system\n");
        out.push_str(i);
        out.push('\n');
    }
    match req.get("input")? {
        Value::String(s) => {
            out.push_str("user\n");
            out.push_str(s);
            out.push('\n');
        }
        Value::Array(items) => out.push_str(&openai::prompt_text(items)),
        _ => return None,
    }
    Some(out)
}

/// The text of a Responses answer: who answered and how many turns it saw.
pub fn responses_text(name: &str, turns: u64, completion_tokens: u64) -> String {
    let words = openai::completion_words(name, completion_tokens);
    let mut text = words.first().cloned().unwrap_or_default();
    text.push_str(&format!(" turn={turns}"));
    for w in words.iter().skip(1) {
        text.push_str(w);
    }
    text
}

pub struct ResponseMeta<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    pub previous_response_id: Option<&'a str>,
    pub store: bool,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

fn message_item(id: &str, text: &str, done: bool) -> Value {
    let content = if done {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    } else {
        json!([])
    };
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "status": if done { "completed" } else { "in_progress" },
        "role": "assistant",
        "content": content,
    })
}

/// A Responses API `response` object; `text` None: in progress.
pub fn response_object(m: &ResponseMeta<'_>, text: Option<&str>) -> Value {
    let (status, output, usage) = match text {
        Some(t) => (
            "completed",
            json!([message_item(m.id, t, true)]),
            json!({
                "input_tokens": m.prompt_tokens,
                "input_tokens_details": {"cached_tokens": m.cached_tokens},
                "output_tokens": m.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": m.prompt_tokens + m.completion_tokens,
            }),
        ),
        None => ("in_progress", json!([]), Value::Null),
    };
    json!({
        "id": m.id,
        "object": "response",
        "created_at": m.created,
        "status": status,
        "model": m.model,
        "output": output,
        "previous_response_id": m.previous_response_id,
        "store": m.store,
        "usage": usage,
        "error": null,
        "incomplete_details": null,
        "instructions": null,
        "metadata": {},
        "parallel_tool_calls": true,
        "temperature": 1.0,
        "top_p": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    })
}

/// The SSE events of a streamed Responses answer, `response.created` first.
pub fn response_events(m: &ResponseMeta<'_>, words: &[String]) -> Vec<String> {
    let text: String = words.concat();
    let item_id = format!("msg_{}", m.id);
    let mut events = vec![
        json!({"type": "response.created", "response": response_object(m, None)}),
        json!({"type": "response.in_progress", "response": response_object(m, None)}),
        json!({"type": "response.output_item.added", "output_index": 0,
               "item": message_item(m.id, "", false)}),
        json!({"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
    ];
    for w in words {
        events.push(
            json!({"type": "response.output_text.delta", "item_id": item_id,
                           "output_index": 0, "content_index": 0, "delta": w, "logprobs": []}),
        );
    }
    events.extend([
        json!({"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
               "content_index": 0, "text": text, "logprobs": []}),
        json!({"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
               "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}),
        json!({"type": "response.output_item.done", "output_index": 0,
               "item": message_item(m.id, &text, true)}),
        json!({"type": "response.completed", "response": response_object(m, Some(&text))}),
    ]);
    events
        .into_iter()
        .enumerate()
        .map(|(i, mut e)| {
            if let Some(o) = e.as_object_mut() {
                o.insert("sequence_number".into(), json!(i));
            }
            sse_event(&e)
        })
        .collect()
}

/// The prompt text of an Anthropic Messages request: its system prompt, then the messages.
pub fn messages_prompt(req: &Value) -> Option<String> {
    let messages = req.get("messages")?.as_array()?;
    let mut out = String::new();
    match req.get("system") {
        Some(Value::String(s)) => {
            out.push_str("system\n");
            out.push_str(s);
            out.push('\n');
        }
        Some(Value::Array(blocks)) => {
            out.push_str(&openai::prompt_text(&[
                json!({"role": "system", "content": blocks}),
            ]));
        }
        _ => {}
    }
    out.push_str(&openai::prompt_text(messages));
    Some(out)
}

pub struct MessageMeta<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

fn message_usage(m: &MessageMeta<'_>) -> Value {
    json!({
        "input_tokens": m.prompt_tokens.saturating_sub(m.cached_tokens),
        "cache_read_input_tokens": m.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": m.completion_tokens,
    })
}

/// An Anthropic `message` answer.
pub fn message_object(m: &MessageMeta<'_>, text: &str) -> Value {
    json!({
        "id": m.id,
        "type": "message",
        "role": "assistant",
        "model": m.model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": message_usage(m),
    })
}

/// The SSE events of a streamed Anthropic answer.
pub fn message_events(m: &MessageMeta<'_>, words: &[String]) -> Vec<String> {
    let mut start = message_object(m, "");
    if let Some(o) = start.as_object_mut() {
        o.insert("content".into(), json!([]));
        o.insert("stop_reason".into(), Value::Null);
    }
    let mut events = vec![
        json!({"type": "message_start", "message": start}),
        json!({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}),
    ];
    for w in words {
        events.push(json!({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": w}}));
    }
    events.extend([
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
               "usage": {"output_tokens": m.completion_tokens}}),
        json!({"type": "message_stop"}),
    ]);
    events.iter().map(sse_event).collect()
}

/// `event: <type>` then the JSON as `data`.
fn sse_event(e: &Value) -> String {
    let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
    format!("event: {kind}\ndata: {e}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(raw.as_bytes()), enc);
        }
    }

    #[test]
    fn naive_form_parser_reads_fields_and_file_size() {
        let body = b"--xx\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n\
--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n12345\r\n--xx--\r\n";
        let f = parse_form("multipart/form-data; boundary=xx", body).unwrap();
        assert_eq!(f.fields.get("model").map(String::as_str), Some("whisper-1"));
        assert_eq!(f.file_bytes, 5);
    }
}
