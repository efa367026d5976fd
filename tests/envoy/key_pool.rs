//! A pool of API keys of one provider behind ONE Envoy cluster, through a real Envoy: the
//! endpoints share their `cluster` and differ only by their `headers` (the key). This is how a
//! pool of hundreds of keys is configured without hundreds of clusters (Envoy's own cost per
//! request grows with the clusters it routes among, see docs/performance.md).
//!
//! What must hold: every request reaches the provider with exactly the key of the endpoint the
//! filter chose (never a client's own `authorization`, never another key's); sessions spread over
//! the keys; a 429 on one key fails over to another key of the same cluster, carrying that key.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::{json, Value};
use support::{post_chat, steady_mock, Envoy, EnvoyConfig};

fn chat() -> String {
    json!({"model": "m1", "messages": [{"role": "user", "content": "hello there"}]}).to_string()
}

/// The `authorization` each logged request carried, oldest first.
fn keys_seen(requests: &[Value]) -> Vec<String> {
    requests
        .iter()
        .map(|r| {
            r.pointer("/headers/authorization")
                .and_then(Value::as_str)
                .unwrap_or("-")
                .to_string()
        })
        .collect()
}

#[test]
fn keys_sharing_one_cluster_each_carry_their_own_key_and_fail_over_to_each_other() {
    let provider = steady_mock("provider", 0);
    let keys = ["k1", "k2", "k3"];
    let endpoints: Vec<Value> = keys
        .iter()
        .map(|k| {
            json!({"name": k, "cluster": "provider",
                   "headers": {"authorization": format!("Bearer sk-{k}")}})
        })
        .collect();
    let e = Envoy::start(EnvoyConfig::new(
        json!({"endpoints": endpoints, "session_header": "x-session-id"}),
        &[("provider", provider.port)],
    ));

    // 1. Sessions spread over the keys; each request carries its chosen key only.
    let mut chosen = Vec::new();
    for s in 0..24 {
        let sid = format!("pool-{s}");
        let r = post_chat(
            e.port,
            &[
                ("x-session-id", sid.as_str()),
                ("authorization", "Bearer client-own"),
            ],
            &chat(),
        );
        assert_eq!(r.status, 200, "session {sid}: {}", r.body);
        chosen.push(
            r.header("x-computeflux-endpoint")
                .unwrap_or("?")
                .to_string(),
        );
    }
    let seen = keys_seen(&provider.requests());
    let expected: Vec<String> = chosen.iter().map(|k| format!("Bearer sk-{k}")).collect();
    println!("chosen {chosen:?}");
    assert_eq!(
        seen, expected,
        "each request carries the chosen endpoint's key, in order"
    );
    for k in keys {
        assert!(
            chosen.iter().any(|c| c == k),
            "24 sessions use every key of the pool, {k} too: {chosen:?}"
        );
    }

    // 2. A 429 on the first key tried: the request fails over to another key of the same
    //    cluster and carries that key.
    provider.reset_stats();
    provider.set_fault(json!({"mode": "status", "status": 429, "retry_after": "30", "count": 1}));
    let r = post_chat(e.port, &[("x-session-id", "pool-failover")], &chat());
    let seen = keys_seen(&provider.requests());
    println!("failover: status {}, keys seen {seen:?}", r.status);
    assert_eq!(r.status, 200, "answered after failover: {}", r.body);
    assert_eq!(seen.len(), 2, "one 429 then one answer: {seen:?}");
    assert_ne!(seen[0], seen[1], "the failover took another key: {seen:?}");
    let answered = r.header("x-computeflux-endpoint").unwrap_or("?");
    assert_eq!(
        seen[1],
        format!("Bearer sk-{answered}"),
        "the answer came with the key of the endpoint the filter reports"
    );
    assert!(e.wasm_crashes().is_empty(), "{:?}", e.wasm_crashes());
}
