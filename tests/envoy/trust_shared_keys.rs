//! Issue 41, items 1 and 2, through a real Envoy: no client drains or kills a shared key.
//!
//! Two hosted keys `a` and `b`, each injecting its own credential and answering with OpenAI's
//! `x-ratelimit-*` headers.
//! - Item 1: requests with `max_tokens: 10000000`, refused by the provider with a 400, leave
//!   the keys' remembered token counts as they were: the session pinned to `b` stays. Before,
//!   each refusal left its key at 0 (the estimate was given back only on a success or a 429),
//!   and the pinned session moved for all its next turns.
//! - Item 2: a client's `OpenAI-Organization` header, which OpenAI answers with a 401 for a
//!   key of another organization, is withheld from endpoints that inject their own key: the
//!   401 never happens, no key is marked dead, pins stay and new sessions still reach `b`.
//!   Before, each such request marked a dead key on every key it tried, and `b` got none of
//!   the next new sessions.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::{json, Value};
use support::http::Response;
use support::placement::{header_session, starts_with};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

const H_ENDPOINT: &str = "x-computeflux-endpoint";
const H_AFFINITY: &str = "x-computeflux-affinity";
const FAST: [&str; 4] = ["--prefill-us-per-token", "0", "--decode-ms", "0"];
const EQUAL: [(&str, f64); 2] = [("a", 1.0), ("b", 1.0)];

struct Keys {
    mocks: Vec<MockUpstream>,
    envoy: Envoy,
}

/// Keys `a` and `b` serving `m1`, each with a quota of 60 000 tokens a 2-minute window.
fn keys() -> Keys {
    let mocks: Vec<MockUpstream> = ["a", "b"]
        .iter()
        .map(|n| MockUpstream::start(n, &["m1"], &FAST))
        .collect();
    for m in &mocks {
        m.set_quota(
            json!({"tokens": 60_000, "requests": 10_000, "window_ms": 120_000,
                           "headers_family": "openai"}),
        );
    }
    let plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "a", "models": ["m1"],
             "headers": {"authorization": "Bearer sk-key-a"}},
            {"name": "b", "cluster": "b", "models": ["m1"],
             "headers": {"authorization": "Bearer sk-key-b"}},
        ],
        "max_attempts": 2,
        "tuning": {"retry_budget_min_retries": 1000},
        "rate_limit_ms": 60_000,
        "quota_aware": true,
    });
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    Keys { mocks, envoy }
}

impl Keys {
    fn mock(&self, name: &str) -> &MockUpstream {
        self.mocks.iter().find(|m| m.name == name).unwrap()
    }
}

/// A session id (sent as `x-session-id`) whose rendezvous home is `home`.
fn session_homed_on(home: &str, tag: &str) -> String {
    (0..10_000)
        .map(|i| format!("{tag}-{i}"))
        .find(|id| starts_with(header_session(id), &EQUAL, &[home]))
        .unwrap()
}

/// Turn `n` of `session` (about 300 prompt tokens), with extra `headers` and body fields.
fn turn(port: u16, session: &str, n: usize, headers: &[(&str, &str)], extra: Value) -> Response {
    let mut h = vec![("x-session-id", session)];
    h.extend_from_slice(headers);
    let mut msgs = vec!["tell me about the sea. ".repeat(50)];
    msgs.extend((2..=n).map(|i| format!("turn {i} of {session}")));
    let msgs: Vec<&str> = msgs.iter().map(String::as_str).collect();
    post_chat(port, &h, &chat_body("m1", &msgs, extra))
}

fn served(r: &Response) -> (u16, Option<&str>) {
    (r.status, r.header(H_ENDPOINT))
}

/// Item 1: six requests with `max_tokens: 10000000`, each refused with a 400 by whichever key
/// takes it, move no pinned session: S (on `b`) and T (on `a`) stay for their next turns.
#[test]
fn refused_requests_with_huge_max_tokens_move_no_pinned_session() {
    let k = keys();
    let port = k.envoy.port;
    let s = session_homed_on("b", "drain-s");
    let t = session_homed_on("a", "drain-t");
    assert_eq!(
        served(&turn(port, &s, 1, &[], Value::Null)),
        (200, Some("b"))
    );
    assert_eq!(
        served(&turn(port, &t, 1, &[], Value::Null)),
        (200, Some("a"))
    );
    let too_large = json!({"mode": "status", "status": 400, "body":
        r#"{"error":{"message":"max_tokens is too large: 10000000. This model supports at most 16384 completion tokens.","type":"invalid_request_error","param":"max_tokens","code":"invalid_value"}}"#});
    for m in &k.mocks {
        m.set_fault(too_large.clone());
    }
    let mut refused = 0;
    for i in 0..6 {
        let x = format!("drain-x-{i}");
        let r = turn(port, &x, 1, &[], json!({"max_tokens": 10_000_000}));
        assert_eq!(r.status, 400, "{}", r.body);
        refused += 1;
    }
    assert_eq!(refused, 6);
    for m in &k.mocks {
        m.clear_fault();
    }
    for n in 2..=4 {
        for (id, home) in [(&s, "b"), (&t, "a")] {
            let r = turn(port, id, n, &[], Value::Null);
            assert_eq!(
                (r.status, r.header(H_ENDPOINT), r.header(H_AFFINITY)),
                (200, Some(home), Some("hit")),
                "{id} turn {n} moved off {home} after refused huge requests: {}",
                r.body
            );
        }
    }
    assert_eq!(k.mock("a").count_429() + k.mock("b").count_429(), 0);
}

/// Item 2: twelve requests carrying `OpenAI-Organization: org-nope` (which key `b` would
/// answer with a 401: the organization is not its own) mark no key dead: S stays pinned to `b`, and new sessions homed on `b`
/// still go there. The header never reaches the keys.
#[test]
fn a_clients_organization_header_marks_no_shared_key_dead() {
    let k = keys();
    let port = k.envoy.port;
    let s = session_homed_on("b", "org-s");
    assert_eq!(
        served(&turn(port, &s, 1, &[], Value::Null)),
        (200, Some("b"))
    );
    let mismatch = json!({"mode": "status", "status": 401, "when_header": "openai-organization",
        "body": r#"{"error":{"message":"OpenAI-Organization header should match organization for API key","type":"invalid_request_error","param":null,"code":"mismatched_organization"}}"#});
    // The client's organization is `a`'s, not `b`'s: `b` refuses it.
    k.mock("b").set_fault(mismatch);
    let mut refused = Vec::new();
    for i in 0..12 {
        let x = format!("org-x-{i}");
        let r = turn(
            port,
            &x,
            1,
            &[
                ("openai-organization", "org-nope"),
                ("openai-project", "proj-nope"),
            ],
            Value::Null,
        );
        if r.status != 200 {
            refused.push((i, r.status));
        }
    }
    for n in 2..=4 {
        let r = turn(port, &s, n, &[], Value::Null);
        assert_eq!(
            (r.status, r.header(H_ENDPOINT), r.header(H_AFFINITY)),
            (200, Some("b"), Some("hit")),
            "S turn {n} moved off b: {}",
            r.body
        );
    }
    let mut on_b = 0;
    for i in 0..6 {
        let id = session_homed_on("b", &format!("org-new-{i}"));
        let r = turn(port, &id, 1, &[], Value::Null);
        assert_eq!(r.status, 200, "{}", r.body);
        on_b += usize::from(r.header(H_ENDPOINT) == Some("b"));
    }
    assert_eq!(
        on_b, 6,
        "new sessions homed on b went elsewhere (refused: {refused:?})"
    );
    assert!(refused.is_empty(), "refused: {refused:?}");
    assert_eq!(
        ["a", "b"]
            .iter()
            .map(|n| k
                .mock(n)
                .stats()
                .pointer("/status_counts/401")
                .and_then(Value::as_u64)
                .unwrap_or(0))
            .sum::<u64>(),
        0,
        "a client's organization header reached a key"
    );
}
