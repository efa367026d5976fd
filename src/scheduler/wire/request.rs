//! Reading what the router needs from a JSON inference request, and nothing more.
//!
//! One parser serves every JSON API of [`crate::scheduler::wire::api`]: chat completions, completions,
//! embeddings, the Responses API and Anthropic Messages all carry `model` at the top level, and
//! their conversation shapes differ only in where the history and the system prompt live.
//!
//! The body is untrusted: it is parsed once, with borrowed raw values for the parts we only hash
//! (message contents), so no prompt text is copied or logged. serde_json's recursion limit turns
//! absurdly nested JSON into an error instead of a stack overflow.
//!
//! The same pass reads every session key the body carries (`prompt_cache_key`, `user` or
//! `metadata.user_id`, and a conversation fingerprint: hash of the model, the system prompt and
//! the first user message — what every turn of one conversation resends unchanged, so clients
//! that send no session id still stick across turns). Which of them, or of the session headers,
//! keys the session is decided in [`crate::scheduler::wire::session`]. The history is
//! `messages` (chat, Messages) or, for the Responses API, `input` (an array of items, or a
//! string: the user message); the system prompt is the top-level `system` (Messages) or
//! `instructions` (Responses), else the first `system` / `developer` message.
//!
//! The same pass over the messages hashes the request's instructions segment (top-level
//! `system` / `instructions`, `tools`, `functions`, the leading system / developer messages):
//! what an application's sessions share, for placement by prefix (see
//! [`crate::scheduler::wire::prefix`]).

use crate::scheduler::state::hash::hash_parts;
use crate::scheduler::wire::api::Api;
use crate::scheduler::wire::multipart::{read_model, MultipartError};
use crate::scheduler::wire::prefix::{InstructionsHasher, Part, Segment};
use crate::scheduler::wire::prompt_size;
pub use crate::scheduler::wire::reply::openai_error;
use crate::scheduler::wire::reply::{RejectReason, Reply};
use crate::scheduler::wire::text;
use serde::Deserialize;
use serde_json::value::RawValue;

pub use crate::scheduler::wire::MAX_MODEL_BYTES;
const FINGERPRINT_SEED: u64 = 0x6669_6e67_6572_7072;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    pub model: String,
    pub user: Option<String>,
    /// Where the `prompt_cache_key` string's bytes (between its quotes, as sent) are in the
    /// body: read in place by [`derive_session`], never copied.
    pub prompt_cache_key: Option<std::ops::Range<usize>>,
    /// Conversation fingerprint, when the body has a user message.
    pub fingerprint: Option<u64>,
    /// The instructions segment (system prompt, tools, leading system messages; see
    /// [`crate::scheduler::wire::prefix`]), when the body has one: where its parts are in the
    /// body, hashed when a placement needs its key ([`Segment::hash`]).
    pub instructions: Option<Box<Segment>>,
    pub stream: bool,
    /// The body carries earlier turns: at least [`FOLLOW_UP_ITEMS`] messages (or Responses
    /// `input` items). Counted, not parsed: a first turn with few-shot examples counts too,
    /// which only makes it go to its home like a later turn would.
    pub follow_up: bool,
    /// The most output tokens the request allows (`max_completion_tokens`, `max_tokens`,
    /// `max_output_tokens`), if it says: hosted APIs charge it to the key's token quota when
    /// they admit the request, so quota-aware routing counts it too.
    pub max_output_tokens: Option<u64>,
    /// The prompt's size for the quota estimate: the body's bytes with each inline media item
    /// counted as [`prompt_size::MEDIA_BYTES`] (an upload form is one media item).
    pub prompt_bytes: u64,
}

/// Above this a stated output limit is not believed (no model writes 10^7 tokens).
pub const MAX_OUTPUT_TOKENS: u64 = 10_000_000;

/// Messages (or input items) from which a request is a later turn: system, user, assistant,
/// user — or user, assistant, user.
pub const FOLLOW_UP_ITEMS: usize = 3;

/// Why a request is refused before it reaches any endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    EmptyBody,
    TooLarge {
        limit: u64,
    },
    InvalidJson(String),
    NotAnObject,
    MissingModel,
    ModelNotString,
    ModelTooLong,
    /// The body's content type contradicts its API (see `api::Handling::WrongContentType`).
    UnsupportedContentType(Api),
    /// A multipart form that cannot be read (see [`MultipartError`]).
    Multipart(MultipartError),
    /// The request path is ambiguous or not canonical (`api::Handling::InvalidPath`).
    InvalidPath(super::path::PathError),
}

impl RequestError {
    pub fn status(&self) -> u16 {
        match self {
            RequestError::TooLarge { .. } => 413,
            RequestError::UnsupportedContentType(_) => 415,
            RequestError::Multipart(e) => e.status(),
            _ => 400,
        }
    }

    pub fn reason(&self) -> RejectReason {
        match self {
            RequestError::EmptyBody => RejectReason::EmptyBody,
            RequestError::TooLarge { .. } => RejectReason::RequestTooLarge,
            RequestError::InvalidJson(_) => RejectReason::InvalidJson,
            RequestError::NotAnObject => RejectReason::InvalidRequestBody,
            RequestError::MissingModel => RejectReason::MissingModel,
            RequestError::ModelNotString | RequestError::ModelTooLong => RejectReason::InvalidModel,
            RequestError::UnsupportedContentType(_) => RejectReason::UnsupportedContentType,
            RequestError::Multipart(e) => e.reason(),
            RequestError::InvalidPath(_) => RejectReason::InvalidPath,
        }
    }

    /// The error `code` of the answer.
    pub fn code(&self) -> &'static str {
        self.reason().label()
    }

    /// The local reply that refuses the request.
    pub fn reply(&self) -> Reply {
        Reply::new(self.status(), self.reason(), &self.message())
    }

    pub fn message(&self) -> String {
        match self {
            RequestError::EmptyBody => {
                "The request body is empty; expected a JSON chat completion request.".into()
            }
            RequestError::TooLarge { limit } => {
                format!("The request body exceeds the limit of {limit} bytes.")
            }
            RequestError::InvalidJson(e) => format!("The request body is not valid JSON: {e}."),
            RequestError::NotAnObject => "The request body must be a JSON object.".into(),
            RequestError::MissingModel => "You must provide a model parameter.".into(),
            RequestError::ModelNotString => "The model parameter must be a string.".into(),
            RequestError::ModelTooLong => {
                format!("The model parameter must be at most {MAX_MODEL_BYTES} bytes.")
            }
            RequestError::UnsupportedContentType(api) => {
                let expected = match api.body() {
                    crate::scheduler::wire::api::BodyFormat::Json => {
                        "a JSON body (application/json)"
                    }
                    crate::scheduler::wire::api::BodyFormat::Multipart => {
                        "a multipart/form-data body"
                    }
                };
                format!("This endpoint ({}) takes {expected}.", api.label())
            }
            RequestError::Multipart(e) => e.message(),
            RequestError::InvalidPath(e) => e.message(),
        }
    }
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    user: Option<&'a RawValue>,
    /// OpenAI's cache key (Chat Completions, Responses): a session key.
    #[serde(borrow, default)]
    prompt_cache_key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    /// Anthropic Messages: `{"user_id": …}`. Chat's `metadata` is a string map: same shape.
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    /// Anthropic Messages' system prompt (a string or content blocks).
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    /// The Responses API's system prompt.
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    /// The Responses API's input: a string (one user message) or an array of items.
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    /// Tool definitions (chat, Responses, Messages): part of the instructions segment.
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    /// Chat's legacy function definitions.
    #[serde(borrow, default)]
    functions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    /// The Responses API's output limit.
    #[serde(borrow, default)]
    max_output_tokens: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// Parses the JSON body of any JSON inference API (chat completions, completions, embeddings,
/// responses, messages).
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, RequestError> {
    parse_chat_with(body, true)
}

/// [`parse_chat`], hashing the instructions segment only when `instructions` (placement by
/// prefix on): off, [`ChatRequest::instructions`] is `None` and the pass costs what it did
/// before placement by prefix.
pub fn parse_chat_with(body: &[u8], instructions: bool) -> Result<ChatRequest, RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        None => return Err(RequestError::EmptyBody),
        Some(b'{') => {}
        Some(b'[' | b'"' | b't' | b'f' | b'n' | b'-' | b'0'..=b'9') => {
            // Valid JSON perhaps, but not an object: say so only if it parses.
            return Err(
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Ok(_) => RequestError::NotAnObject,
                    Err(e) => RequestError::InvalidJson(short(&e)),
                },
            );
        }
        Some(_) => {}
    }
    // One pass for the nesting depth and the prompt size (`prompt_size::scan`).
    let scanned = prompt_size::scan(body);
    if scanned.depth > MAX_DEPTH {
        return Err(RequestError::InvalidJson(format!(
            "nesting deeper than {MAX_DEPTH} levels"
        )));
    }
    let parsed: Body<'_> =
        serde_json::from_slice(body).map_err(|e| RequestError::InvalidJson(short(&e)))?;
    let model = match parsed.model {
        None => return Err(RequestError::MissingModel),
        Some(raw) => match serde_json::from_str::<String>(raw.get()) {
            Ok(m) if m.is_empty() => return Err(RequestError::MissingModel),
            Ok(m) if m.len() > MAX_MODEL_BYTES => return Err(RequestError::ModelTooLong),
            Ok(m) => m,
            Err(_) if raw.get() == "null" => return Err(RequestError::MissingModel),
            Err(_) => return Err(RequestError::ModelNotString),
        },
    };
    let session_string = |raw: &RawValue| {
        serde_json::from_str::<String>(raw.get())
            .ok()
            .filter(|u| !u.is_empty())
    };
    let metadata_user = || {
        let meta = serde_json::from_str::<Metadata<'_>>(parsed.metadata?.get()).ok()?;
        session_string(meta.user_id?)
    };
    let user = parsed.user.and_then(session_string).or_else(metadata_user);
    let prompt_cache_key = parsed
        .prompt_cache_key
        .and_then(|raw| string_bytes(body, raw));
    let stream = parsed.stream.is_some_and(|raw| raw.get() == "true");
    let system = parsed.system.or(parsed.instructions).map(RawValue::get);
    // The instructions segment, in its canonical order (see `prefix`); the leading messages
    // are added by the same pass that finds the fingerprint's messages.
    let mut lead = if instructions {
        InstructionsHasher::new(body, &model)
    } else {
        InstructionsHasher::off()
    };
    for (part, raw) in [
        (Part::System, parsed.system),
        (Part::Instructions, parsed.instructions),
        (Part::Tools, parsed.tools),
        (Part::Functions, parsed.functions),
    ] {
        if let Some(raw) = raw.filter(|r| r.get() != "null") {
            lead.add(part, raw.get());
        }
    }
    let mut items_seen = 0usize;
    let fingerprint = match (parsed.messages.as_deref(), parsed.input) {
        (Some(msgs), _) => {
            items_seen = msgs.len();
            fingerprint(&model, system, msgs, &mut lead)
        }
        (None, Some(input)) => match serde_json::from_str::<Vec<&RawValue>>(input.get()) {
            Ok(items) => {
                items_seen = items.len();
                fingerprint(&model, system, &items, &mut lead)
            }
            // A string input is the user message itself.
            Err(_) if input.get().starts_with('"') => {
                Some(fingerprint_hash(&model, system, input.get()))
            }
            Err(_) => None,
        },
        (None, None) => None,
    };
    let instructions = lead.finish();
    // A plain count, believed up to [`MAX_OUTPUT_TOKENS`]; anything else is no statement.
    let max_output_tokens = [
        parsed.max_completion_tokens,
        parsed.max_tokens,
        parsed.max_output_tokens,
    ]
    .into_iter()
    .flatten()
    .find_map(|raw| raw.get().parse::<u64>().ok())
    .filter(|n| *n <= MAX_OUTPUT_TOKENS);
    Ok(ChatRequest {
        model,
        user,
        prompt_cache_key,
        fingerprint,
        instructions,
        stream,
        follow_up: items_seen >= FOLLOW_UP_ITEMS,
        max_output_tokens,
        prompt_bytes: scanned.prompt_bytes,
    })
}

/// Where a non-empty JSON string's content (between its quotes, escapes as sent) lies in
/// `body`, which `raw` was borrowed from.
fn string_bytes(body: &[u8], raw: &RawValue) -> Option<std::ops::Range<usize>> {
    let s = raw.get();
    if s.len() < 3 || !s.starts_with('"') || !s.ends_with('"') {
        return None;
    }
    let start = (s.as_ptr() as usize).checked_sub(body.as_ptr() as usize)? + 1;
    let range = start..start + s.len() - 2;
    // Borrowed from `body`, so always true; checked rather than assumed.
    (body.get(range.clone())? == s.as_bytes().get(1..s.len() - 1)?).then_some(range)
}

/// Deepest JSON nesting accepted. serde_json ignores unknown fields iteratively without a
/// depth bound; an upstream parser may not be so forgiving, so the filter refuses such bodies.
pub const MAX_DEPTH: usize = 128;

/// Hash of (model, system prompt, first user message), when there is a user message. `system`
/// is a top-level system prompt; without one, the first system / developer message is used.
/// The leading system / developer messages (before any other role) are added to `lead`, the
/// instructions segment, in the same pass.
fn fingerprint(
    model: &str,
    system: Option<&str>,
    messages: &[&RawValue],
    lead: &mut InstructionsHasher<'_>,
) -> Option<u64> {
    let mut system: Option<&str> = system;
    let mut user: Option<&str> = None;
    let mut leading = true;
    for raw in messages {
        let Ok(m) = serde_json::from_str::<Message<'_>>(raw.get()) else {
            leading = false;
            continue;
        };
        let role = m.role.map(|r| r.get());
        let content = m.content.map_or("", |c| c.get());
        let instruction = matches!(role, Some("\"system\"") | Some("\"developer\""));
        leading &= instruction;
        if leading {
            lead.add(Part::Message, raw.get());
        }
        match role {
            Some("\"system\"") | Some("\"developer\"") if system.is_none() => {
                system = Some(content)
            }
            Some("\"user\"") if user.is_none() => user = Some(content),
            _ => {}
        }
        if user.is_some() && system.is_some() && !leading {
            break;
        }
    }
    Some(fingerprint_hash(model, system, user?))
}

fn fingerprint_hash(model: &str, system: Option<&str>, user: &str) -> u64 {
    hash_parts(
        FINGERPRINT_SEED,
        &[
            model.as_bytes(),
            system.unwrap_or("").as_bytes(),
            user.as_bytes(),
        ],
    )
}

/// Longest part of serde_json's error text quoted back (it may quote the client's input).
const MAX_JSON_ERROR_BYTES: usize = 160;

fn short(e: &serde_json::Error) -> String {
    text::truncate(&e.to_string(), MAX_JSON_ERROR_BYTES).to_string()
}

/// The routing view of a whole form: its model, and never a session from the body (pass it to
/// [`derive_session`], which then uses the session headers or nothing).
pub fn parse_form(content_type: &str, body: &[u8]) -> Result<ChatRequest, RequestError> {
    read_model(content_type, body)
        .map(form_request)
        .map_err(RequestError::Multipart)
}

/// The routing view of a form whose model a [`ModelScan`](crate::scheduler::wire::multipart::ModelScan) found.
pub fn form_request(model: String) -> ChatRequest {
    ChatRequest {
        model,
        user: None,
        prompt_cache_key: None,
        fingerprint: None,
        instructions: None,
        stream: false,
        follow_up: false,
        max_output_tokens: None,
        prompt_bytes: prompt_size::MEDIA_BYTES,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::wire::session::{derive_session, SessionHeaders, SessionSource};

    /// The word-at-a-time scan against the plain byte loop, on bodies full of strings,
    /// escapes and brackets at every alignment.
    #[test]
    fn the_scans_depth_equals_the_byte_loop() {
        fn bytewise(body: &[u8]) -> usize {
            let (mut depth, mut max, mut in_str, mut escaped) = (0usize, 0usize, false, false);
            for &b in body {
                if in_str {
                    match (escaped, b) {
                        (true, _) => escaped = false,
                        (false, b'\\') => escaped = true,
                        (false, b'"') => in_str = false,
                        _ => {}
                    }
                    continue;
                }
                match b {
                    b'"' => in_str = true,
                    b'[' | b'{' => {
                        depth += 1;
                        max = max.max(depth);
                    }
                    b']' | b'}' => depth = depth.saturating_sub(1),
                    _ => {}
                }
            }
            max
        }
        let alphabet = b"\"\\[]{}ab \xc3\xa9\x00\x7f\x80\xff";
        let mut state = 7u64;
        for len in 0..200usize {
            for _ in 0..20 {
                let body: Vec<u8> = (0..len)
                    .map(|_| {
                        state = crate::scheduler::state::hash::fmix64(state.wrapping_add(1));
                        // Mostly plain text, so that long runs take the fast path.
                        if state.is_multiple_of(4) {
                            alphabet[(state >> 8) as usize % alphabet.len()]
                        } else {
                            b'a' + (state >> 16) as u8 % 26
                        }
                    })
                    .collect();
                assert_eq!(prompt_size::scan(&body).depth, bytewise(&body), "{body:?}");
            }
        }
        let long = format!(
            "{{\"a\":[\"{}\\\"{}\"],\"b\":[[{{}}]]}}",
            "x".repeat(1000),
            "y".repeat(77)
        );
        assert_eq!(prompt_size::scan(long.as_bytes()).depth, 4);
        assert_eq!(
            prompt_size::scan(long.as_bytes()).depth,
            bytewise(long.as_bytes())
        );
    }

    #[test]
    fn later_turns_are_counted_not_parsed() {
        let first = br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#;
        assert!(!parse_chat(first).unwrap().follow_up);
        let later = br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}"#;
        assert!(parse_chat(later).unwrap().follow_up);
        let input = br#"{"model":"m","input":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}"#;
        assert!(parse_chat(input).unwrap().follow_up);
        assert!(
            !parse_chat(br#"{"model":"m","input":"hi"}"#)
                .unwrap()
                .follow_up
        );
    }
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The output limit, under any of its names; a value that is not a plain count (or is
    /// implausibly large) is no statement.
    #[test]
    fn reads_the_output_limit() {
        let limit = |body: &str| parse_chat(body.as_bytes()).unwrap().max_output_tokens;
        assert_eq!(limit(r#"{"model":"m","max_tokens":256}"#), Some(256));
        assert_eq!(
            limit(r#"{"model":"m","max_completion_tokens":64,"max_tokens":9}"#),
            Some(64)
        );
        assert_eq!(
            limit(r#"{"model":"m","max_output_tokens":1000}"#),
            Some(1_000)
        );
        assert_eq!(limit(r#"{"model":"m"}"#), None);
        for odd in ["-1", "1.5", "\"9\"", "null", "99999999999", "1e3"] {
            assert_eq!(
                limit(&format!(r#"{{"model":"m","max_tokens":{odd}}}"#)),
                None,
                "{odd}"
            );
        }
    }

    #[test]
    fn extracts_model_user_stream_and_fingerprint() {
        let body = br#"{"model":"gpt-4o","user":"u1","stream":true,"messages":[
            {"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#;
        let r = parse_chat(body).unwrap();
        assert_eq!(r.model, "gpt-4o");
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert!(r.stream);
        // The next turn resends the same first messages plus more: same fingerprint.
        let turn2 = br#"{"model":"gpt-4o","messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#;
        assert_eq!(parse_chat(turn2).unwrap().fingerprint, r.fingerprint);
        let other = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"bye"}]}"#;
        assert_ne!(parse_chat(other).unwrap().fingerprint, r.fingerprint);
    }

    #[test]
    fn refuses_bad_bodies_with_defined_errors() {
        assert_eq!(parse_chat(b"").unwrap_err(), RequestError::EmptyBody);
        assert_eq!(parse_chat(b"  \n").unwrap_err(), RequestError::EmptyBody);
        assert!(matches!(
            parse_chat(b"{nope").unwrap_err(),
            RequestError::InvalidJson(_)
        ));
        assert_eq!(parse_chat(b"[1,2]").unwrap_err(), RequestError::NotAnObject);
        assert_eq!(parse_chat(b"\"x\"").unwrap_err(), RequestError::NotAnObject);
        assert_eq!(parse_chat(b"{}").unwrap_err(), RequestError::MissingModel);
        assert_eq!(
            parse_chat(br#"{"model":null}"#).unwrap_err(),
            RequestError::MissingModel
        );
        assert_eq!(
            parse_chat(br#"{"model":7}"#).unwrap_err(),
            RequestError::ModelNotString
        );
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(100_000));
        assert_eq!(
            parse_chat(long.as_bytes()).unwrap_err(),
            RequestError::ModelTooLong
        );
        let deep = format!(
            r#"{{"model":"m","x":{}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(matches!(
            parse_chat(deep.as_bytes()).unwrap_err(),
            RequestError::InvalidJson(_)
        ));
        assert!(matches!(
            parse_chat(b"{\"model\":\"\xff\"}").unwrap_err(),
            RequestError::InvalidJson(_)
        ));
        let ok_depth = format!(
            r#"{{"model":"m","x":{}"[{{\"]"{}}}"#,
            "[".repeat(127),
            "]".repeat(127)
        );
        assert_eq!(parse_chat(ok_depth.as_bytes()).unwrap().model, "m");
        let e = RequestError::TooLarge { limit: 10 };
        assert_eq!((e.status(), e.code()), (413, "request_too_large"));
    }

    /// serde_json's message quotes the client's text; cutting it at byte 160 inside
    /// a two-byte character panicked (and killed the wasm VM).
    #[test]
    fn invalid_json_error_cut_inside_a_multibyte_character_does_not_panic() {
        let body = format!(
            r#"{{"model":"llama-3-8b","messages":"a{}"}}"#,
            "é".repeat(200)
        );
        let RequestError::InvalidJson(msg) = parse_chat(body.as_bytes()).unwrap_err() else {
            panic!("expected invalid_json");
        };
        assert!(msg.len() <= MAX_JSON_ERROR_BYTES, "{msg}");
        let e = RequestError::InvalidJson(msg);
        assert_eq!((e.status(), e.code()), (400, "invalid_json"));
        assert!(e.reply().body().contains("invalid_json"));
    }

    #[test]
    fn session_precedence_and_tenant_scoping() {
        let body = br#"{"model":"m","user":"u","messages":[{"role":"user","content":"q"}]}"#;
        let r = parse_chat(body).unwrap();
        let (h, src) = derive_session(None, SessionHeaders::configured(b"s1"), &r, body);
        assert_eq!(src, SessionSource::Header);
        let (u, src) = derive_session(None, SessionHeaders::default(), &r, body);
        assert_eq!(src, SessionSource::User);
        assert_ne!(h, u);
        let no_user = br#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#;
        let r2 = parse_chat(no_user).unwrap();
        assert_eq!(
            derive_session(None, SessionHeaders::default(), &r2, no_user).1,
            SessionSource::Fingerprint
        );
        let bare = br#"{"model":"m"}"#;
        assert_eq!(
            derive_session(
                None,
                SessionHeaders::default(),
                &parse_chat(bare).unwrap(),
                bare
            ),
            (None, SessionSource::None)
        );
        // Same session id, different tenants: different keys.
        let s1 = SessionHeaders::configured(b"s1");
        let a = derive_session(Some(b"Bearer A"), s1, &r, body).0;
        let b = derive_session(Some(b"Bearer B"), s1, &r, body).0;
        assert_ne!(a, b);
        // A long session header is hashed, not refused.
        let huge = vec![b'x'; 10 * 1024];
        let (k, src) = derive_session(None, SessionHeaders::configured(&huge), &r, body);
        assert_eq!(src, SessionSource::Header);
        assert!(k.is_some());
    }

    #[test]
    fn messages_session_from_metadata_user_id() {
        let turn1 = br#"{"model":"claude","max_tokens":8,"system":"be brief",
            "metadata":{"user_id":"user_1_session_9"},
            "messages":[{"role":"user","content":"hi"}]}"#;
        let r = parse_chat(turn1).unwrap();
        assert_eq!(r.user.as_deref(), Some("user_1_session_9"));
        let none = SessionHeaders::default();
        let (key, src) = derive_session(Some(b"k"), none, &r, turn1);
        assert_eq!(src, SessionSource::User);
        // The header still wins.
        assert_eq!(
            derive_session(Some(b"k"), SessionHeaders::configured(b"s"), &r, turn1).1,
            SessionSource::Header
        );
        // A body `user` wins over metadata.user_id (chat completions may carry both).
        let both = br#"{"model":"m","user":"u","metadata":{"user_id":"x"}}"#;
        assert_eq!(parse_chat(both).unwrap().user.as_deref(), Some("u"));
        // Without metadata: the fingerprint, with the top-level system prompt, stable across
        // turns and different from another system prompt.
        let bare1 = br#"{"model":"claude","system":"be brief","messages":[{"role":"user","content":"hi"}]}"#;
        let bare2 =
            br#"{"model":"claude","system":"be brief","messages":[{"role":"user","content":"hi"},
            {"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#;
        let other =
            br#"{"model":"claude","system":"be long","messages":[{"role":"user","content":"hi"}]}"#;
        let fp = |b: &[u8]| parse_chat(b).unwrap().fingerprint;
        assert!(fp(bare1).is_some());
        assert_eq!(fp(bare1), fp(bare2));
        assert_ne!(fp(bare1), fp(other));
        let r2 = parse_chat(bare1).unwrap();
        let (fkey, src) = derive_session(Some(b"k"), none, &r2, bare1);
        assert_eq!(src, SessionSource::Fingerprint);
        assert_ne!(key, fkey);
        // Malformed metadata is ignored, not an error.
        for meta in [r#""x""#, r#"{"user_id":7}"#, r#"{"user_id":""}"#, "null"] {
            let body = format!(r#"{{"model":"m","metadata":{meta}}}"#);
            assert_eq!(parse_chat(body.as_bytes()).unwrap().user, None, "{meta}");
        }
    }

    #[test]
    fn responses_input_gives_a_fingerprint() {
        let fp = |b: &str| parse_chat(b.as_bytes()).unwrap().fingerprint;
        let as_string = r#"{"model":"m","input":"hi"}"#;
        let as_items = r#"{"model":"m","input":[{"role":"user","content":"hi"}]}"#;
        let replayed = r#"{"model":"m","input":[{"role":"user","content":"hi"},
            {"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}"#;
        assert!(fp(as_string).is_some());
        assert_eq!(fp(as_string), fp(as_items));
        assert_eq!(fp(as_items), fp(replayed));
        // Same as the chat body with the same first user message.
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(fp(as_string), fp(chat));
        let instructed = r#"{"model":"m","instructions":"be brief","input":"hi"}"#;
        assert_ne!(fp(instructed), fp(as_string));
        // Inputs that are neither: no fingerprint, no error.
        assert_eq!(fp(r#"{"model":"m","input":7}"#), None);
        assert_eq!(
            fp(r#"{"model":"m","input":[{"type":"function_call_output"}]}"#),
            None
        );
    }

    fn instructions(body: &str) -> Option<crate::scheduler::wire::prefix::Instructions> {
        let r = parse_chat(body.as_bytes()).unwrap();
        r.instructions?.hash(body.as_bytes(), &r.model)
    }

    fn chat(system: &str, rest: &str) -> String {
        format!(r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{rest}]}}"#)
    }

    #[test]
    fn instructions_are_what_precedes_the_conversation() {
        let long = "You are a support agent. ".repeat(60);
        let turn1 = chat(&long, r#"{"role":"user","content":"hi"}"#);
        let turn2 = chat(
            &long,
            r#"{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},
            {"role":"system","content":"later system text is not a prefix"},{"role":"user","content":"more"}"#,
        );
        let other_user = chat(
            &long,
            r#"{"role":"user","content":"something else entirely"}"#,
        );
        let a = instructions(&turn1).unwrap();
        assert_eq!(instructions(&turn2), Some(a));
        assert_eq!(instructions(&other_user), Some(a));
        // Exactly the leading system message as sent.
        let sys = format!(r#"{{"role":"system","content":"{long}"}}"#);
        assert_eq!(a.bytes, sys.len());
        // Another system prompt, another model: another segment.
        let edited = chat(&format!("{long}!"), r#"{"role":"user","content":"hi"}"#);
        assert_ne!(instructions(&edited).unwrap().hash, a.hash);
        let other_model = turn1.replacen(r#""model":"m""#, r#""model":"n""#, 1);
        assert_ne!(instructions(&other_model).unwrap().hash, a.hash);
        // Several leading system / developer messages all count; tools too.
        let two = format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"developer","content":"d"}},{{"role":"user","content":"hi"}}]}}"#
        );
        assert!(instructions(&two).unwrap().bytes > a.bytes);
        let tools = format!(
            r#"{{"model":"m","tools":[{{"type":"function","function":{{"name":"f"}}}}],"messages":[{sys},{{"role":"user","content":"hi"}}]}}"#
        );
        assert_ne!(instructions(&tools).unwrap().hash, a.hash);
        // No instructions at all: none.
        assert_eq!(
            instructions(
                r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"system","content":"x"}]}"#
            ),
            None
        );
        assert_eq!(instructions(r#"{"model":"m","tools":null}"#), None);
    }

    #[test]
    fn instructions_of_messages_and_responses_bodies() {
        let long = "Follow the style guide. ".repeat(60);
        let messages = |user: &str| {
            format!(
                r#"{{"model":"claude","max_tokens":8,"system":"{long}","messages":[{{"role":"user","content":"{user}"}}]}}"#
            )
        };
        let a = instructions(&messages("hi")).unwrap();
        assert_eq!(instructions(&messages("bye")), Some(a));
        assert_eq!(a.bytes, long.len() + 2);
        let responses = |input: &str| {
            format!(r#"{{"model":"claude","instructions":"{long}","input":{input}}}"#)
        };
        let r = instructions(&responses(r#""hi""#)).unwrap();
        assert_eq!(
            instructions(&responses(r#"[{"role":"user","content":"other"}]"#)),
            Some(r)
        );
        // The same text as `system` and as `instructions` is another prefix to the engine.
        assert_ne!(r.hash, a.hash);
        // Leading system items of a Responses input count.
        let items = format!(
            r#"{{"model":"m","input":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"hi"}}]}}"#
        );
        assert!(instructions(&items).unwrap().bytes > long.len());
    }

    #[test]
    fn short_instructions_give_no_prefix_key_and_tenants_are_apart() {
        use crate::scheduler::wire::prefix::prefix_key;
        let short = instructions(&chat("be brief", r#"{"role":"user","content":"hi"}"#)).unwrap();
        assert_eq!(prefix_key(None, &short, 1024), None);
        let long = instructions(&chat(
            &"x".repeat(2000),
            r#"{"role":"user","content":"hi"}"#,
        ))
        .unwrap();
        let k = prefix_key(Some(b"Bearer a"), &long, 1024);
        assert!(k.is_some());
        assert_ne!(k, prefix_key(Some(b"Bearer b"), &long, 1024));
    }

    /// With placement by prefix off the instructions are not hashed: no segment, and the rest
    /// of the parse is the same.
    #[test]
    fn instructions_are_hashed_only_when_asked() {
        let body = chat(&"x".repeat(2000), r#"{"role":"user","content":"hi"}"#);
        let on = parse_chat(body.as_bytes()).unwrap();
        let off = parse_chat_with(body.as_bytes(), false).unwrap();
        assert!(on.instructions.is_some());
        assert_eq!(off.instructions, None);
        assert_eq!(
            ChatRequest {
                instructions: None,
                ..on
            },
            off
        );
    }

    /// Bounded work: the leading segment ends at the first conversation message, so a huge
    /// history after it is never added, and a huge instruction is hashed once, linearly.
    #[test]
    fn huge_bodies_hash_only_their_instructions() {
        let history: Vec<String> = (0..20_000)
            .map(|i| {
                format!(
                    r#"{{"role":"user","content":"message {i} {}"}}"#,
                    "y".repeat(50)
                )
            })
            .collect();
        let body = chat("short system", &history.join(","));
        assert!(body.len() > 1_000_000);
        let i = instructions(&body).unwrap();
        assert_eq!(
            i.bytes,
            r#"{"role":"system","content":"short system"}"#.len()
        );
        let huge_system = "z".repeat(4 * 1024 * 1024);
        let big = chat(&huge_system, r#"{"role":"user","content":"hi"}"#);
        // (No clock on wasm32-unknown-unknown: timed natively only.)
        #[cfg(not(target_arch = "wasm32"))]
        let started = std::time::Instant::now();
        let j = instructions(&big).unwrap();
        assert_eq!(
            j.bytes,
            huge_system.len() + r#"{"role":"system","content":""}"#.len()
        );
        // Generous: a linear scan of 4 MiB takes milliseconds even unoptimised.
        #[cfg(not(target_arch = "wasm32"))]
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        fn text() -> impl Strategy<Value = String> {
            // Every character width, escaped for JSON by serde.
            proptest::collection::vec(any::<char>(), 0..40).prop_map(|c| c.into_iter().collect())
        }

        fn body(system: &str, users: &[String]) -> String {
            let mut msgs = vec![serde_json::json!({"role": "system", "content": system})];
            for (i, u) in users.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                msgs.push(serde_json::json!({"role": role, "content": u}));
            }
            serde_json::json!({"model": "m", "messages": msgs}).to_string()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            #[test]
            fn same_instructions_same_key_whatever_follows(
                system in text(),
                a in proptest::collection::vec(text(), 1..6),
                b in proptest::collection::vec(text(), 1..6),
                sa in "[a-z0-9]{1,12}",
                sb in "[a-z0-9]{1,12}",
            ) {
                let (ba, bb) = (body(&system, &a), body(&system, &b));
                let ra = parse_chat(ba.as_bytes()).unwrap();
                let rb = parse_chat(bb.as_bytes()).unwrap();
                let ia = ra.instructions.as_ref().and_then(|i| i.hash(ba.as_bytes(), "m"));
                let ib = rb.instructions.as_ref().and_then(|i| i.hash(bb.as_bytes(), "m"));
                prop_assert_eq!(ia, ib);
                // Whatever the session: the key does not involve it.
                let (ka, _) = derive_session(None, SessionHeaders::configured(sa.as_bytes()), &ra, ba.as_bytes());
                let (kb, _) = derive_session(None, SessionHeaders::configured(sb.as_bytes()), &rb, bb.as_bytes());
                prop_assert_eq!(ka == kb, sa == sb);
                prop_assert_eq!(
                    crate::scheduler::wire::prefix::prefix_key(None, &ia.unwrap(), 64),
                    crate::scheduler::wire::prefix::prefix_key(None, &ib.unwrap(), 64)
                );
            }

            #[test]
            fn different_system_prompts_different_segments(
                x in text(),
                y in text(),
                user in text(),
            ) {
                prop_assume!(x != y);
                let u = vec![user];
                let ix = instructions(&body(&x, &u)).unwrap();
                let iy = instructions(&body(&y, &u)).unwrap();
                prop_assert_ne!(ix.hash, iy.hash);
            }
        }
    }

    #[test]
    fn new_error_kinds_map_to_statuses() {
        let e = RequestError::UnsupportedContentType(Api::AudioTranscriptions);
        assert_eq!((e.status(), e.code()), (415, "unsupported_content_type"));
        assert!(e.message().contains("multipart/form-data"));
        let m = RequestError::Multipart(MultipartError::Truncated);
        assert_eq!((m.status(), m.code()), (400, "invalid_multipart"));
    }
}
