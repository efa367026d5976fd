#![cfg(not(target_arch = "wasm32"))]
//! Data-parallel ranks (issue 42) through a real Envoy: an endpoint with
//! `data_parallel_size: 2` is two endpoints, `gpu-r0` and `gpu-r1`, on one upstream. Its requests
//! carry `x-data-parallel-rank` 0 or 1 (the mock records every request's headers), the rank of
//! the endpoint that served them; every turn of a session reaches the same rank; both ranks are
//! used; a client's own value never reaches an upstream, neither a ranked one nor a plain one;
//! and a failover call from one rank to the other carries the other's rank.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

mod support;

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

const RANK: &str = "x-data-parallel-rank";

fn fast() -> [&'static str; 4] {
    ["--prefill-us-per-token", "0", "--decode-ms", "1"]
}

/// The engine behind the data-parallel endpoint: two ranks, as configured (the mock refuses a
/// rank it does not have, as vLLM does).
fn two_ranks() -> Vec<&'static str> {
    [&fast()[..], &["--data-parallel-size", "2"]].concat()
}

/// The rank header of each request the mock received, by `x-session-id`, in order.
fn ranks_by_session(mock: &MockUpstream) -> BTreeMap<String, Vec<Option<String>>> {
    let mut out: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for r in mock.requests() {
        let h = &r["headers"];
        let session = h["x-session-id"].as_str().unwrap_or("-").to_string();
        out.entry(session)
            .or_default()
            .push(h[RANK].as_str().map(str::to_string));
    }
    out
}

#[test]
fn each_rank_is_an_endpoint_and_a_session_keeps_its_rank() {
    let gpu = MockUpstream::start("gpu", &[], &two_ranks());
    let solo = MockUpstream::start("solo", &[], &fast());
    let plugin = json!({"endpoints": [
        {"name": "gpu", "cluster": "cg", "data_parallel_size": 2},
        {"name": "solo", "cluster": "cs"}
    ]});
    let envoy = Envoy::start(EnvoyConfig::new(
        plugin,
        &[("cg", gpu.port), ("cs", solo.port)],
    ));
    let mut served: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in 0..16 {
        let session = format!("dp-{s}");
        for turn in 0..3 {
            let msgs: Vec<String> = (0..=turn).map(|t| format!("turn {t}")).collect();
            let msgs: Vec<&str> = msgs.iter().map(String::as_str).collect();
            // Every request carries a client's own rank: it must never pass.
            let r = post_chat(
                envoy.port,
                &[("x-session-id", &session), (RANK, "7")],
                &chat_body("m", &msgs, Value::Null),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            let ep = r.header("x-computeflux-endpoint").unwrap().to_string();
            assert!(["gpu-r0", "gpu-r1", "solo"].contains(&ep.as_str()), "{ep}");
            served.entry(session.clone()).or_default().insert(ep);
        }
    }
    // A session stays on one endpoint, a rank included.
    for (s, eps) in &served {
        assert_eq!(eps.len(), 1, "session {s} moved: {eps:?}");
    }
    let used: BTreeSet<&String> = served.values().flatten().collect();
    assert!(
        used.contains(&"gpu-r0".to_string()) && used.contains(&"gpu-r1".to_string()),
        "both ranks used: {used:?}"
    );
    // What the engine saw: each request of a ranked session carries that rank, never the
    // client's; the plain endpoint gets no rank at all.
    let gpu_seen = ranks_by_session(&gpu);
    assert!(!gpu_seen.is_empty());
    for (s, ranks) in &gpu_seen {
        let ep = served[s].iter().next().unwrap();
        let want = ep
            .strip_prefix("gpu-r")
            .unwrap_or_else(|| panic!("{s} on {ep}"));
        assert_eq!(ranks.len(), 3, "{s}: {ranks:?}");
        assert!(
            ranks.iter().all(|r| r.as_deref() == Some(want)),
            "session {s} on {ep}: {ranks:?}"
        );
    }
    for (s, ranks) in ranks_by_session(&solo) {
        assert!(ranks.iter().all(Option::is_none), "{s}: {ranks:?}");
    }
    // Metrics are per rank.
    let stats = envoy.computeflux_stats();
    for ep in ["gpu-r0", "gpu-r1"] {
        let n = stats
            .get(&format!(
                "wasmcustom.computeflux_requests_total.endpoint.{ep}.outcome.success"
            ))
            .copied()
            .unwrap_or(0);
        assert!(n > 0, "{ep}: {stats:?}");
    }
}

#[test]
fn a_failover_call_to_the_other_rank_carries_its_rank() {
    let gpu = MockUpstream::start("gpu", &[], &two_ranks());
    let plugin = json!({"endpoints": [
        {"name": "gpu", "cluster": "cg", "data_parallel_size": 2}
    ]});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("cg", gpu.port)]));
    gpu.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = post_chat(
        envoy.port,
        &[("x-session-id", "fo-1"), (RANK, "5")],
        &chat_body("m", &["hello"], Value::Null),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    let last = r.header("x-computeflux-endpoint").unwrap().to_string();
    let seen = gpu.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let rank = |i: usize| seen[i]["headers"][RANK].as_str().map(str::to_string);
    let (first, second) = (rank(0), rank(1));
    assert_eq!(seen[0]["status"], 503);
    assert_eq!(seen[1]["status"], 200);
    // The routed attempt and the failover call: the two ranks, each its endpoint's.
    assert_eq!(second.as_deref(), last.strip_prefix("gpu-r"));
    let both: BTreeSet<Option<String>> = [first, second].into_iter().collect();
    assert_eq!(
        both,
        [Some("0".to_string()), Some("1".to_string())]
            .into_iter()
            .collect()
    );
}
