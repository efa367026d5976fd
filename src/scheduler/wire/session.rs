//! Which session a request belongs to: the keys clients already send, in order of preference.
//!
//! Why: an engine keeps a conversation's prefix (KV) cache on one GPU, so every turn of it
//! should reach the same endpoint. Clients name their conversations in several places, and
//! most never set a header the gateway chose; the filter reads what they already send.
//!
//! Sources, first present wins ([`derive_session`]):
//! 1. the configured `session_header` ([`SessionSource::Header`]);
//! 2. the body's `prompt_cache_key` (OpenAI Chat Completions and Responses: requests that share
//!    it are meant to share a cache; [`SessionSource::PromptCacheKey`]);
//! 3. an agent harness's own session header, the first of [`HARNESS_SESSION_HEADERS`] present
//!    ([`SessionSource::HarnessHeader`]);
//! 4. the body's `user`, else `metadata.user_id` (Anthropic Messages; [`SessionSource::User`]);
//! 5. the conversation fingerprint (model, system prompt, first user message;
//!    [`SessionSource::Fingerprint`]).
//!
//! A Responses API follow-up whose `previous_response_id` names a response an endpoint stored
//! goes to that endpoint whatever its session ([`SessionSource::PreviousResponse`], decided in
//! `flow::pins`): only the holder has the previous turn. It sits between the harness headers and
//! `user` in the issue's order; since no other endpoint can serve it, it outranks them all in
//! practice, as before.
//!
//! The explicit ids (1–3) share one namespace: a harness that sends its conversation id both as
//! a header and as `prompt_cache_key` (Codex does) keys the same session whichever decided. A
//! `prompt_cache_key` is taken as its JSON string's bytes as sent (escapes included).
//!
//! Bounded: an id of any length is hashed into the 64-bit affinity key and never stored or
//! refused (a 10 KB key is served like a short one). Every key is scoped by the caller's
//! credential (`authorization` / `x-api-key`, hashed with it), so one tenant can never read or
//! steer another tenant's pins.

use crate::scheduler::state::hash::session_key;
use crate::scheduler::wire::headers::HeaderSource;
use crate::scheduler::wire::request::ChatRequest;
use std::borrow::Cow;

/// Session headers that agent harnesses send on every model request, in the order they are
/// looked for (each names one conversation; a request carrying several is keyed by the first).
/// The configured `session_header` is read before these; a harness missing here is served by
/// setting `session_header` to its header.
pub const HARNESS_SESSION_HEADERS: &[&str] = &[
    // Claude Code: the session id on every API request (its `client.ts` default headers, as the
    // Qwen Code telemetry design documents; read by the vLLM router's program scheduling,
    // vllm-project/router#285, and by the vLLM semantic router).
    "x-claude-code-session-id",
    // Codex CLI: the conversation id as `session_id` (openai/codex
    // `codex-rs/codex-api/src/requests/headers.rs`, `build_conversation_headers`).
    "session_id",
    // Codex / OpenCode per the vLLM router's header schema (vllm-project/router#285:
    // "Codex/OpenCode uses `session-id` and `thread-id`").
    "session-id",
    "thread-id",
    // OpenCode: `x-opencode-session` on requests to its own providers (sst/opencode
    // `session/llm.ts`); to OpenAI-style providers it sends `prompt_cache_key` instead.
    "x-opencode-session",
];

/// Where the session key came from (the `source` label of `computeflux_sessions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    Header,
    PromptCacheKey,
    HarnessHeader,
    PreviousResponse,
    User,
    Fingerprint,
    None,
}

impl SessionSource {
    pub const ALL: &'static [SessionSource] = &[
        SessionSource::Header,
        SessionSource::PromptCacheKey,
        SessionSource::HarnessHeader,
        SessionSource::PreviousResponse,
        SessionSource::User,
        SessionSource::Fingerprint,
        SessionSource::None,
    ];

    pub fn label(&self) -> &'static str {
        match self {
            SessionSource::Header => "header",
            SessionSource::PromptCacheKey => "prompt_cache_key",
            SessionSource::HarnessHeader => "harness_header",
            SessionSource::PreviousResponse => "previous_response_id",
            SessionSource::User => "user",
            SessionSource::Fingerprint => "fingerprint",
            SessionSource::None => "none",
        }
    }
}

/// The session headers of a request, as sent: the configured `session_header` and the first
/// harness header present (see [`harness_header`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionHeaders<'a> {
    pub configured: Option<&'a [u8]>,
    pub harness: Option<&'a [u8]>,
}

impl<'a> SessionHeaders<'a> {
    /// Only the configured session header.
    pub fn configured(value: &'a [u8]) -> Self {
        SessionHeaders {
            configured: Some(value),
            harness: None,
        }
    }
}

/// The value of the first harness session header the request carries, empty ones skipped.
pub fn harness_header<H: HeaderSource + ?Sized>(headers: &H) -> Option<Cow<'_, [u8]>> {
    HARNESS_SESSION_HEADERS
        .iter()
        .find_map(|name| headers.header(name).filter(|v| !v.is_empty()))
}

/// The tenant-scoped affinity key of a request and its source. `tenant` is the caller's
/// credential value (hashed here, never stored); `body` the body `req` was parsed from (its
/// `prompt_cache_key` is read in place).
pub fn derive_session(
    tenant: Option<&[u8]>,
    headers: SessionHeaders<'_>,
    req: &ChatRequest,
    body: &[u8],
) -> (Option<u64>, SessionSource) {
    derive_session_with(
        tenant,
        headers.configured,
        || headers.harness.map(Cow::Borrowed),
        req,
        body,
    )
}

/// [`derive_session`] with the harness header looked up only when the configured header and
/// `prompt_cache_key` did not decide (`harness`, called at most once): most requests that
/// carry a session id carry it there, and the five lookups cost them for nothing.
pub fn derive_session_with<'h>(
    tenant: Option<&[u8]>,
    configured: Option<&[u8]>,
    harness: impl FnOnce() -> Option<Cow<'h, [u8]>>,
    req: &ChatRequest,
    body: &[u8],
) -> (Option<u64>, SessionSource) {
    let tenant = tenant.unwrap_or(b"");
    let explicit = |id: &[u8]| Some(session_key(tenant, &[b"h:", id].concat()));
    if let Some(h) = configured.filter(|h| !h.is_empty()) {
        return (explicit(h), SessionSource::Header);
    }
    let cache_key = req
        .prompt_cache_key
        .clone()
        .and_then(|range| body.get(range))
        .filter(|k| !k.is_empty());
    if let Some(k) = cache_key {
        return (explicit(k), SessionSource::PromptCacheKey);
    }
    if let Some(h) = harness().filter(|h| !h.is_empty()) {
        return (explicit(&h), SessionSource::HarnessHeader);
    }
    if let Some(u) = &req.user {
        return (
            Some(session_key(tenant, &[b"u:", u.as_bytes()].concat())),
            SessionSource::User,
        );
    }
    if let Some(fp) = req.fingerprint {
        return (
            Some(session_key(
                tenant,
                &[&b"f:"[..], &fp.to_le_bytes()].concat(),
            )),
            SessionSource::Fingerprint,
        );
    }
    (None, SessionSource::None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::wire::request::parse_chat;

    fn key(tenant: &[u8], h: SessionHeaders<'_>, body: &str) -> (Option<u64>, SessionSource) {
        let r = parse_chat(body.as_bytes()).unwrap();
        derive_session(Some(tenant), h, &r, body.as_bytes())
    }

    const FULL: &str = r#"{"model":"m","user":"u","prompt_cache_key":"pck-1","messages":[{"role":"user","content":"q"}]}"#;

    /// Each source in turn, by removing the one above it.
    #[test]
    fn sources_in_order() {
        let both = SessionHeaders {
            configured: Some(b"s1"),
            harness: Some(b"claude-1"),
        };
        let harness_only = SessionHeaders {
            configured: None,
            harness: Some(b"claude-1"),
        };
        assert_eq!(key(b"k", both, FULL).1, SessionSource::Header);
        assert_eq!(
            key(b"k", harness_only, FULL).1,
            SessionSource::PromptCacheKey
        );
        let no_pck = r#"{"model":"m","user":"u","messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(
            key(b"k", harness_only, no_pck).1,
            SessionSource::HarnessHeader
        );
        assert_eq!(
            key(b"k", SessionHeaders::default(), no_pck).1,
            SessionSource::User
        );
        let bare = r#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(
            key(b"k", SessionHeaders::default(), bare).1,
            SessionSource::Fingerprint
        );
        assert_eq!(
            key(b"k", SessionHeaders::default(), r#"{"model":"m"}"#),
            (None, SessionSource::None)
        );
        // Empty values are absent.
        let empty = SessionHeaders {
            configured: Some(b""),
            harness: Some(b""),
        };
        let empty_pck = r#"{"model":"m","prompt_cache_key":"","user":"u"}"#;
        assert_eq!(key(b"k", empty, empty_pck).1, SessionSource::User);
        // A prompt_cache_key that is not a string is no key.
        for v in ["7", "null", "{}", "[\"a\"]"] {
            let b = format!(r#"{{"model":"m","prompt_cache_key":{v},"user":"u"}}"#);
            assert_eq!(
                key(b"k", SessionHeaders::default(), &b).1,
                SessionSource::User
            );
        }
    }

    /// The explicit ids share one namespace: the same id is the same session whichever source
    /// carried it; other ids, other tenants and `user` are other sessions.
    #[test]
    fn explicit_ids_share_a_namespace_scoped_by_tenant() {
        let by_header = key(b"k", SessionHeaders::configured(b"pck-1"), FULL).0;
        let by_pck = key(b"k", SessionHeaders::default(), FULL).0;
        let harness = SessionHeaders {
            configured: None,
            harness: Some(b"pck-1"),
        };
        let by_harness = key(b"k", harness, r#"{"model":"m"}"#).0;
        assert!(by_header.is_some());
        assert_eq!(by_header, by_pck);
        assert_eq!(by_pck, by_harness);
        assert_ne!(key(b"other", SessionHeaders::default(), FULL).0, by_pck);
        let other = FULL.replace("pck-1", "pck-2");
        assert_ne!(key(b"k", SessionHeaders::default(), &other).0, by_pck);
        let user = r#"{"model":"m","user":"pck-1"}"#;
        assert_ne!(key(b"k", SessionHeaders::default(), user).0, by_pck);
    }

    /// A key of any length is hashed, never refused; long keys that differ in their last byte
    /// are different sessions.
    #[test]
    fn long_keys_are_hashed_not_refused() {
        let long = "x".repeat(10 * 1024);
        let a = key(b"k", SessionHeaders::configured(long.as_bytes()), FULL);
        assert_eq!(a.1, SessionSource::Header);
        let longer = format!("{long}y");
        let b = key(b"k", SessionHeaders::configured(longer.as_bytes()), FULL);
        assert!(a.0.is_some() && b.0.is_some() && a.0 != b.0);
        let body = format!(r#"{{"model":"m","prompt_cache_key":"{long}"}}"#);
        assert_eq!(
            key(b"k", SessionHeaders::default(), &body),
            (a.0, SessionSource::PromptCacheKey)
        );
        let user = format!(r#"{{"model":"m","user":"{long}"}}"#);
        assert_eq!(
            key(b"k", SessionHeaders::default(), &user).1,
            SessionSource::User
        );
    }

    #[test]
    fn the_first_harness_header_present_is_taken() {
        let list = |pairs: &[(&str, &str)]| -> Vec<(String, Vec<u8>)> {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect()
        };
        let sent = list(&[("thread-id", "t-1"), ("X-Claude-Code-Session-Id", "c-1")]);
        assert_eq!(
            harness_header(sent.as_slice()).as_deref(),
            Some(&b"c-1"[..])
        );
        let empty_first = list(&[("x-claude-code-session-id", ""), ("session_id", "s")]);
        assert_eq!(
            harness_header(empty_first.as_slice()).as_deref(),
            Some(&b"s"[..])
        );
        assert_eq!(
            harness_header(list(&[("x-session-id", "a")]).as_slice()),
            None
        );
    }

    /// The harness headers are looked up only when the configured header and
    /// `prompt_cache_key` did not decide, and then once.
    #[test]
    fn harness_lookup_only_when_undecided() {
        let lookups = std::cell::Cell::new(0u32);
        let harness = || {
            lookups.set(lookups.get() + 1);
            Some(Cow::Borrowed(&b"claude-1"[..]))
        };
        let derive = |configured: Option<&[u8]>, body: &str| {
            let r = parse_chat(body.as_bytes()).unwrap();
            derive_session_with(Some(b"k"), configured, harness, &r, body.as_bytes()).1
        };
        assert_eq!(derive(Some(b"s1"), FULL), SessionSource::Header);
        assert_eq!(derive(None, FULL), SessionSource::PromptCacheKey);
        assert_eq!(lookups.get(), 0);
        let no_pck = r#"{"model":"m","user":"u","messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(derive(Some(b""), no_pck), SessionSource::HarnessHeader);
        assert_eq!(lookups.get(), 1);
    }

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<&str> = SessionSource::ALL.iter().map(|s| s.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), SessionSource::ALL.len());
    }
}
