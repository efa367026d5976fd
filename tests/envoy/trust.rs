//! Issue 22 through a real Envoy: one client's request must not decide what happens to other
//! clients' traffic, and what goes upstream is what the filter classified.
//!
//! Fleet (the issue's documented configuration): `a` and `b` serve `m1`, `c` serves `m1` and
//! `m2`; no endpoint injects credentials.
//! - An encoded or ambiguous path (`/v1/%63hat/completions`, `//v1/…`, dot segments, `%2F`
//!   that names another API) is refused with `400 invalid_path` and reaches no upstream;
//!   before, it was routed without a model, to endpoints that do not serve it.
//! - A pass-through upload (`POST /v1/files`, body never read) is not failed over: the one
//!   endpoint that got it got all of it, and its 429 is relayed; before, the failover calls
//!   reached the other endpoints with an empty body.
//! - An OpenAI-style 429 "Request too large … Limit 30000, Requested 52000" without reset
//!   headers is the request's fault: relayed, and the endpoint is not cooled, so another
//!   client's session pinned to it stays; before, it moved for `rate_limit_ms`.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::http::{self, Response};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

const H_ENDPOINT: &str = "x-computeflux-endpoint";
const H_ATTEMPTS: &str = "x-computeflux-attempts";
const CLUSTERS: [&str; 3] = ["a", "b", "c"];

struct Fleet {
    a: MockUpstream,
    b: MockUpstream,
    c: MockUpstream,
    envoy: Envoy,
}

fn start() -> Fleet {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "0"];
    let a = MockUpstream::start("a", &["m1"], &fast);
    let b = MockUpstream::start("b", &["m1"], &fast);
    let c = MockUpstream::start("c", &["m1", "m2"], &fast);
    let plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "a", "models": ["m1"]},
            {"name": "b", "cluster": "b", "models": ["m1"]},
            {"name": "c", "cluster": "c", "models": ["m1", "m2"]},
        ],
        "max_attempts": 3,
        "tuning": {"retry_budget_min_retries": 1000},
        // Long enough that a cooled endpoint stays cooled for the whole test.
        "rate_limit_ms": 60_000,
        "max_body_bytes": 1024 * 1024,
    });
    let cfg = EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port), ("c", c.port)]);
    let envoy = Envoy::start(cfg);
    Fleet { a, b, c, envoy }
}

impl Fleet {
    fn mocks(&self) -> [&MockUpstream; 3] {
        [&self.a, &self.b, &self.c]
    }

    /// Requests Envoy sent to each upstream cluster (routed or dispatched, any path).
    fn upstream_counts(&self) -> Vec<i64> {
        CLUSTERS
            .iter()
            .map(|c| {
                self.envoy
                    .stat(&format!("cluster.{c}.upstream_rq_total"))
                    .unwrap_or(0)
            })
            .collect()
    }
}

fn send(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    http::request(
        port,
        method,
        path,
        headers,
        Some(body),
        Duration::from_secs(10),
    )
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn error_code(r: &Response) -> String {
    serde_json::from_str::<Value>(&r.body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Item 1: `POST /v1/%63hat/completions` with `m2` was served by `a` and `b`, which do not
/// serve `m2`. Every spelling of a path that is not its canonical form, or whose `%2F` names
/// another API once decoded, is refused by the filter and reaches no upstream.
#[test]
fn encoded_and_ambiguous_paths_are_refused_and_reach_no_upstream() {
    let f = start();
    let body = chat_body("m2", &["which path am I?"], Value::Null);
    for path in [
        "/v1/%63hat/completions",
        "/v1/%63%68%61%74/completions",
        "//v1/chat/completions",
        "/v1//chat/completions",
        "/v1/files/../chat/completions",
        "/v1/./chat/completions",
        "/v1%2Fchat%2Fcompletions",
        "/v1/responses/x%2F..%2F..%2Fchat%2Fcompletions",
        "/v1/%2563hat/completions",
    ] {
        for _ in 0..3 {
            let before = f.upstream_counts();
            let r = send(f.envoy.port, "POST", path, &[], body.as_bytes());
            assert_eq!(
                (r.status, error_code(&r).as_str()),
                (400, "invalid_path"),
                "POST {path}: {} {}",
                r.status,
                r.body
            );
            assert_eq!(
                f.upstream_counts(),
                before,
                "POST {path} reached an upstream"
            );
        }
    }
    // Nothing with m2 ever reached a or b.
    for m in [&f.a, &f.b] {
        let m2: Vec<Value> = m
            .requests()
            .into_iter()
            .filter(|r| r["model"] == "m2")
            .collect();
        assert!(m2.is_empty(), "{} got m2 requests: {m2:?}", m.name);
    }
    // The canonical path is served by the one endpoint that serves m2; an encoded `/` inside a
    // model id is still a model id.
    let r = send(
        f.envoy.port,
        "POST",
        "/v1/chat/completions",
        &[],
        body.as_bytes(),
    );
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some("c")),
        "{}",
        r.body
    );
    let r = http::get(f.envoy.port, "/v1/models/org%2Fm1");
    assert_ne!(error_code(&r), "invalid_path", "{}", r.body);
}

/// Item 2: a pass-through upload while the endpoints answer 429: before, the failover calls
/// reached the other endpoints with 0 bytes. Now the upload is not replayed: exactly one
/// endpoint got it, with all 5 000 bytes, and its 429 is what the client gets.
#[test]
fn a_pass_through_upload_is_not_replayed_without_its_body() {
    let f = start();
    for m in f.mocks() {
        m.set_fault(json!({"mode": "status", "status": 429}));
    }
    let upload = vec![b'x'; 5000];
    let r = send(
        f.envoy.port,
        "POST",
        "/v1/files",
        &[("content-type", "application/octet-stream")],
        &upload,
    );
    assert_eq!(
        (r.status, r.header(H_ATTEMPTS)),
        (429, Some("1")),
        "{}",
        r.body
    );
    let got: Vec<(String, u64)> = f
        .mocks()
        .iter()
        .flat_map(|m| {
            m.requests()
                .into_iter()
                .filter(|r| r["path"] == "/v1/files")
                .map(|r| (m.name.clone(), r["body_bytes"].as_u64().unwrap_or(0)))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        got.len(),
        1,
        "the upload reached more than one endpoint: {got:?}"
    );
    assert!(
        got.iter().all(|(_, bytes)| *bytes == 5000),
        "an endpoint got a truncated upload: {got:?}"
    );
}

const TPM_429: &str = r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 52000. The input or output tokens must be reduced in order to run successfully.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;

/// A first turn for a new session named `user` until one lands on `endpoint`.
fn session_on(f: &Fleet, endpoint: &str, prefix: &str) -> String {
    for i in 0..200 {
        let user = format!("{prefix}-{i}");
        let r = post_chat(
            f.envoy.port,
            &[],
            &chat_body("m1", &["turn 1"], json!({"user": user})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header(H_ENDPOINT) == Some(endpoint) {
            return user;
        }
    }
    panic!("no session landed on {endpoint}");
}

/// Item 3: client X's oversized request is answered by `a` with OpenAI's 429 "Request too
/// large … Requested 52000" and no reset headers. X gets that answer (it is X's fault, and no
/// other key would serve it either), and client Y, whose session is pinned to `a`, keeps its
/// next turns on `a`. Before, `a` was cooled for `rate_limit_ms` and Y moved.
#[test]
fn an_oversized_request_429_does_not_move_other_clients_off_the_key() {
    let f = start();
    let y = session_on(&f, "a", "client-y");
    let x = session_on(&f, "a", "client-x");
    f.a.set_fault(json!({"mode": "status", "status": 429, "body": TPM_429, "count": 1}));
    let big = "word ".repeat(40_000);
    let r = post_chat(
        f.envoy.port,
        &[],
        &chat_body("m1", &["turn 1", &big], json!({"user": x})),
    );
    assert_eq!(
        (r.status, r.header(H_ENDPOINT), r.header(H_ATTEMPTS)),
        (429, Some("a"), Some("1")),
        "X: {}",
        r.body
    );
    assert!(
        r.body.contains("Request too large"),
        "relayed as is: {}",
        r.body
    );
    // Y's next turns stay on a.
    let mut turns = vec!["turn 1".to_string()];
    for n in 2..=5 {
        turns.push(format!("turn {n}"));
        let msgs: Vec<&str> = turns.iter().map(String::as_str).collect();
        let r = post_chat(
            f.envoy.port,
            &[],
            &chat_body("m1", &msgs, json!({"user": y})),
        );
        assert_eq!(
            (r.status, r.header(H_ENDPOINT)),
            (200, Some("a")),
            "Y turn {n} moved: {}",
            r.body
        );
    }
    // A 429 that is a rate limit (no size words) still cools a and fails over.
    f.a.set_fault(json!({"mode": "status", "status": 429, "count": 1}));
    turns.push("turn 6".into());
    let msgs: Vec<&str> = turns.iter().map(String::as_str).collect();
    let r = post_chat(
        f.envoy.port,
        &[],
        &chat_body("m1", &msgs, json!({"user": y})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.header(H_ENDPOINT), Some("a"), "a rate limit fails over");
}
