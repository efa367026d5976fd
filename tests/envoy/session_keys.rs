//! The session keys clients already send (issue 42), through a real Envoy in front of three
//! mock endpoints: requests sharing `prompt_cache_key` (Chat Completions and Responses, no
//! session header, every request opening with a different message) stay on one endpoint;
//! Anthropic Messages requests sharing `x-claude-code-session-id` do too; a 10 KB key is
//! served; and `computeflux_sessions_total` says which source decided.
//!
//! Each request opens with its own first message, so its fingerprint differs from its
//! siblings': without the key they scatter over the endpoints (checked as a control).

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::{json, Value};
use std::collections::BTreeSet;
use support::http::{request, DEFAULT_TIMEOUT};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream, Response};

fn fleet() -> (Vec<MockUpstream>, Envoy) {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "1"];
    let names = ["a", "b", "c"];
    let mocks: Vec<MockUpstream> = names
        .iter()
        .map(|n| MockUpstream::start(n, &[], &fast))
        .collect();
    let eps: Vec<Value> = names
        .iter()
        .map(|n| json!({"name": n, "cluster": format!("c{n}")}))
        .collect();
    let clusters: Vec<(String, u16)> = names
        .iter()
        .zip(&mocks)
        .map(|(n, m)| (format!("c{n}"), m.port))
        .collect();
    let clusters: Vec<(&str, u16)> = clusters.iter().map(|(c, p)| (c.as_str(), *p)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(json!({ "endpoints": eps }), &clusters));
    (mocks, envoy)
}

fn served(r: &Response) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.header("x-computeflux-endpoint"),
        r.header("x-mock-endpoint")
    );
    (
        r.header("x-mock-endpoint").unwrap_or("").to_string(),
        r.header("x-computeflux-affinity").unwrap_or("").to_string(),
    )
}

fn post(port: u16, path: &str, headers: &[(&str, &str)], body: &Value) -> Response {
    request(
        port,
        "POST",
        path,
        headers,
        Some(body.to_string().as_bytes()),
        DEFAULT_TIMEOUT,
    )
    .expect("request")
}

fn sessions(envoy: &Envoy, source: &str) -> i64 {
    envoy
        .stat(&format!(
            "wasmcustom.computeflux_sessions_total.source.{source}"
        ))
        .unwrap_or(0)
}

/// Every request of one key on one endpoint (`home` then `hit`); the keys spread.
fn assert_sticky(runs: &[Vec<(String, String)>]) {
    let mut homes = BTreeSet::new();
    for run in runs {
        let first = &run[0].0;
        for (i, (ep, affinity)) in run.iter().enumerate() {
            assert_eq!(ep, first, "{run:?}");
            assert_eq!(affinity, if i == 0 { "home" } else { "hit" }, "{run:?}");
        }
        homes.insert(first.clone());
    }
    assert!(homes.len() >= 2, "keys all on one endpoint: {runs:?}");
}

#[test]
fn prompt_cache_key_keeps_chat_and_responses_requests_together() {
    let (_mocks, envoy) = fleet();
    let port = envoy.port;
    // Control: without a key, the same requests follow their differing fingerprints.
    let mut scattered = BTreeSet::new();
    for i in 0..8 {
        let r = post_chat(
            port,
            &[],
            &chat_body("m", &[&format!("opening {i}")], json!({})),
        );
        scattered.insert(served(&r).0);
    }
    assert!(scattered.len() >= 2, "fingerprints all on one endpoint");
    let before = sessions(&envoy, "prompt_cache_key");
    // Chat Completions: 6 keys × 4 requests, each opening differently.
    let chat: Vec<Vec<(String, String)>> = (0..6)
        .map(|k| {
            (0..4)
                .map(|i| {
                    let body = chat_body(
                        "m",
                        &[&format!("key {k} request {i}")],
                        json!({"prompt_cache_key": format!("agent-{k}")}),
                    );
                    served(&post_chat(port, &[], &body))
                })
                .collect()
        })
        .collect();
    assert_sticky(&chat);
    // The Responses API: the same field, `input` instead of `messages`.
    let responses: Vec<Vec<(String, String)>> = (0..6)
        .map(|k| {
            (0..4)
                .map(|i| {
                    let body = json!({
                        "model": "m", "store": false,
                        "input": format!("responses key {k} request {i}"),
                        "prompt_cache_key": format!("resp-agent-{k}"),
                    });
                    served(&post(port, "/v1/responses", &[], &body))
                })
                .collect()
        })
        .collect();
    assert_sticky(&responses);
    assert_eq!(sessions(&envoy, "prompt_cache_key") - before, 48);
    // A 10 KB key is served, and sticks.
    let long = "k".repeat(10 * 1024);
    let run: Vec<(String, String)> = (0..3)
        .map(|i| {
            let body = chat_body(
                "m",
                &[&format!("long key {i}")],
                json!({ "prompt_cache_key": long }),
            );
            served(&post_chat(port, &[], &body))
        })
        .collect();
    assert!(run.iter().all(|(ep, _)| *ep == run[0].0), "{run:?}");
    assert_eq!(run[2].1, "hit");
}

#[test]
fn claude_code_session_header_keeps_messages_requests_together() {
    let (_mocks, envoy) = fleet();
    let port = envoy.port;
    let send = |session: &str, first: &str| {
        let body = json!({
            "model": "claude", "max_tokens": 8,
            "system": "You are Claude Code.",
            "messages": [{"role": "user", "content": first}],
        });
        let r = post(
            port,
            "/v1/messages",
            &[
                ("x-api-key", "sk-ant-test"),
                ("anthropic-version", "2023-06-01"),
                ("x-claude-code-session-id", session),
            ],
            &body,
        );
        assert_eq!(r.json()["type"], "message", "{}", r.body);
        served(&r)
    };
    let before = sessions(&envoy, "harness_header");
    // A main agent, its sub-agents and a compaction: every request opens differently.
    let runs: Vec<Vec<(String, String)>> = (0..6)
        .map(|k| {
            let id = format!("0b6c3f2e-5d1a-4c7e-9f00-00000000000{k}");
            (0..4)
                .map(|i| send(&id, &format!("session {k} task {i}")))
                .collect()
        })
        .collect();
    assert_sticky(&runs);
    assert_eq!(sessions(&envoy, "harness_header") - before, 24);
    // A 10 KB header value is served, and sticks.
    let long = "c".repeat(10 * 1024);
    let a = send(&long, "long one");
    let b = send(&long, "long two");
    assert_eq!((a.1.as_str(), b.1.as_str()), ("home", "hit"));
    assert_eq!(a.0, b.0);
    // The configured session header outranks the harness header.
    let before = sessions(&envoy, "header");
    let body = json!({"model": "claude", "max_tokens": 8,
        "messages": [{"role": "user", "content": "x"}]});
    let r = post(
        port,
        "/v1/messages",
        &[
            ("x-session-id", "explicit"),
            ("x-claude-code-session-id", "harness"),
        ],
        &body,
    );
    served(&r);
    assert_eq!(sessions(&envoy, "header") - before, 1);
}
