//! Whose fault a failing answer is: the endpoint's (cool it, fail over) or the request's own
//! (relay it, leave the endpoint alone).
//!
//! Why: a failing answer that a request brings on itself says nothing about the endpoint. Once,
//! one client's oversized prompt answered with a 429 cooled the key for
//! `rate_limit_ms`, moving every other client's pinned sessions off it, and failing over only
//! sent the same hopeless request to the next key. Answers that are the request's own fault are
//! [`Outcome::ClientError`]: relayed to the client as they are, no breaker change, no
//! success-rate sample, no failover (see `outcome`).
//!
//! | provider answer | fields used | classification |
//! |---|---|---|
//! | 429 with `retry-after`, `retry-after-ms` or `x-ratelimit-reset-*` | the headers | `RateLimited` (the key's quota; cooled for the hint) |
//! | 429 without those headers, body says `Request too large` (OpenAI TPM: `"message":"Request too large for gpt-4o … Limit 30000, Requested 52000"`, `"code":"rate_limit_exceeded"`), or `request_too_large`, or `requested … limit` / `… limit … requested` | the first [`JUDGE_BYTES`] of the body, case-insensitive | `ClientError` (no key could serve it) |
//! | 429 without those headers, any other body (or none) | — | `RateLimited` |
//! | 413 (Anthropic `{"type":"error","error":{"type":"request_too_large"}}`, any proxy's limit) | the status | `ClientError` |
//! | 401 / 403, endpoint injects credentials (`authorization`, `x-api-key` or `api-key` in its `headers`) | the endpoint's configuration | `DeadKey` (the endpoint's key; the client's credential-scoping headers, [`SCOPING_HEADERS`], are withheld from such an endpoint, so a client cannot draw this 401) |
//! | 401 / 403, endpoint injects none | the endpoint's configuration | `ClientError` (the client's own key) |
//! | 400, 404, 422, other 4xx | the status | `ClientError` |
//!
//! The body is read only for a 429 without reset hints, and only its first [`JUDGE_BYTES`]: the
//! filter holds that answer at its headers until its body ends or that many bytes arrived,
//! then either relays it or fails over (`flow`).

use crate::scheduler::config::EndpointConfig;
use crate::scheduler::health::outcome::Outcome;

/// How much of a 429's body is read to judge it (error bodies are a few hundred bytes).
pub const JUDGE_BYTES: usize = 4096;

/// Credential headers an endpoint may inject (lower case).
const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

/// Whether the endpoint sends its own credentials (its configured `headers` name one).
pub fn injects_credentials(ep: &EndpointConfig) -> bool {
    ep.headers
        .iter()
        .any(|(n, _)| CREDENTIAL_HEADERS.iter().any(|c| n.eq_ignore_ascii_case(c)))
}

/// Request headers that scope a credential (lower case): which of the key's organizations or
/// projects a request is billed to and authorized against (OpenAI's `OpenAI-Organization` and
/// `OpenAI-Project`, Google Cloud's `x-goog-user-project`). When the endpoint injects its
/// own credential, the client's are withheld ([`withheld`]): the key is the operator's, so
/// the client may not choose whose quota and bill it draws on, and a mismatched one is a 401
/// that would be blamed on the key ([`by_endpoint`]) and mark a shared key dead for every
/// client. An operator who needs one sets it in the endpoint's `headers`.
pub const SCOPING_HEADERS: [&str; 3] = [
    "openai-organization",
    "openai-project",
    "x-goog-user-project",
];

/// Whether a client's request header `name` is withheld from endpoint `ep`: a credential-
/// scoping header ([`SCOPING_HEADERS`]) when the endpoint injects its own credential.
pub fn withheld(ep: &EndpointConfig, name: &str) -> bool {
    SCOPING_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h)) && injects_credentials(ep)
}

/// The client's request headers withheld from endpoint `ep` (see [`withheld`]): none when it
/// injects no credential (the client's own key, with its own scoping, goes through).
pub fn withheld_headers(ep: &EndpointConfig) -> &'static [&'static str] {
    if injects_credentials(ep) {
        &SCOPING_HEADERS
    } else {
        &[]
    }
}

/// `outcome` of an answer from `ep`, with the blame of a 401/403 moved to the request when the
/// endpoint injects no credentials (the client's own key was refused).
pub fn by_endpoint(outcome: Outcome, ep: Option<&EndpointConfig>) -> Outcome {
    match (outcome, ep) {
        (Outcome::DeadKey, Some(ep)) if !injects_credentials(ep) => Outcome::ClientError,
        (o, _) => o,
    }
}

/// Whether a 429's body (its first bytes) says the request itself is too large for any key:
/// `request too large` / `request_too_large`, or a number after `requested` larger than the
/// number after `limit` (OpenAI's "Limit 30000, Requested 52000"; its ordinary quota answer
/// "Limit 30000, Used 29000, Requested 2000" asks for less than the limit and stays a rate
/// limit).
pub fn too_large(body_head: &[u8]) -> bool {
    let head = body_head.get(..JUDGE_BYTES).unwrap_or(body_head);
    let lower = head.to_ascii_lowercase();
    if find(&lower, b"request too large").is_some() || find(&lower, b"request_too_large").is_some()
    {
        return true;
    }
    match (
        number_after(&lower, b"requested"),
        number_after(&lower, b"limit"),
    ) {
        (Some(requested), Some(limit)) => requested > limit,
        _ => false,
    }
}

/// The number right after the first `word` followed by one (spaces, `:` and `=` skipped).
fn number_after(hay: &[u8], word: &[u8]) -> Option<u64> {
    let mut from = 0;
    while let Some(at) = hay.get(from..).and_then(|h| find(h, word)) {
        let rest = hay.get(from + at + word.len()..)?;
        let digits: Vec<u8> = rest
            .iter()
            .skip_while(|b| matches!(b, b' ' | b':' | b'='))
            .take_while(|b| b.is_ascii_digit() || **b == b',')
            .filter(|b| b.is_ascii_digit())
            .take(18)
            .copied()
            .collect();
        if !digits.is_empty() {
            return std::str::from_utf8(&digits).ok()?.parse().ok();
        }
        from += at + word.len();
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The outcome of a 429 without reset hints, judged by its body's first bytes.
pub fn judge_429(body_head: &[u8]) -> Outcome {
    if too_large(body_head) {
        Outcome::ClientError
    } else {
        Outcome::RateLimited {
            retry_after_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const OPENAI_TPM: &str = r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 52000. The input or output tokens must be reduced in order to run successfully.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
    const OPENAI_RATE: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 2s.","type":"tokens","code":"rate_limit_exceeded"}}"#;

    #[test]
    fn oversized_requests_are_the_requests_fault() {
        assert_eq!(judge_429(OPENAI_TPM.as_bytes()), Outcome::ClientError);
        let anthropic =
            br#"{"type":"error","error":{"type":"request_too_large","message":"Request exceeds the maximum size"}}"#;
        assert_eq!(judge_429(anthropic), Outcome::ClientError);
        assert!(too_large(b"tokens: requested 9000, limit 8192"));
    }

    #[test]
    fn quota_answers_stay_rate_limits() {
        let limited = Outcome::RateLimited {
            retry_after_ms: None,
        };
        assert_eq!(judge_429(b""), limited);
        assert_eq!(
            judge_429(b"{\"error\":{\"message\":\"slow down\"}}"),
            limited
        );
        assert_eq!(judge_429(b"limit reached; requested too often"), limited);
        // "Limit 30000, Used 29000, Requested 2000": the key's quota, not the request's size.
        assert_eq!(judge_429(OPENAI_RATE.as_bytes()), limited);
    }

    #[test]
    fn only_the_head_is_read() {
        let mut body = vec![b' '; JUDGE_BYTES];
        body.extend_from_slice(b"Request too large");
        assert!(!too_large(&body));
    }

    #[test]
    fn own_credentials_are_the_clients() {
        let cfg = crate::scheduler::Config::from_json(
            br#"{"endpoints":[{"name":"a","cluster":"a"},
                {"name":"b","cluster":"b","headers":{"Authorization":"Bearer k"}},
                {"name":"c","cluster":"c","headers":{"api-key":"k"}}]}"#,
        )
        .unwrap();
        let [a, b, c] = [0, 1, 2].map(|i| &cfg.endpoints[i]);
        assert_eq!(by_endpoint(Outcome::DeadKey, Some(a)), Outcome::ClientError);
        assert_eq!(by_endpoint(Outcome::DeadKey, Some(b)), Outcome::DeadKey);
        assert_eq!(by_endpoint(Outcome::DeadKey, Some(c)), Outcome::DeadKey);
        assert_eq!(by_endpoint(Outcome::DeadKey, None), Outcome::DeadKey);
        assert_eq!(
            by_endpoint(
                Outcome::RateLimited {
                    retry_after_ms: None
                },
                Some(a)
            ),
            Outcome::RateLimited {
                retry_after_ms: None
            }
        );
    }
}
