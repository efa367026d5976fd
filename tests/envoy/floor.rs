//! The overhead benchmark's floor module (`examples/floor_filter.rs`) through a real Envoy:
//! what the benchmark calls "the cost any body-routing proxy-wasm filter pays" is only that if
//! the module really pauses, buffers the body and routes on the header it sets.
//!
//! What must hold: every request (small and multi-chunk bodies, a request without a body, one
//! carrying a client-sent routing header naming the other cluster) reaches the configured
//! cluster and none the other; nothing in Envoy's log shows a panic; a configuration without a
//! cluster stops Envoy from starting, with the module's own message. With `"clusters": N`, a
//! session's requests all reach one of the N clusters and sessions reach more than one.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::json;
use support::{get, post_chat, steady_mock, Checks, Envoy, EnvoyConfig};

/// The floor module, built (under the harness's build lock) if needed.
fn floor_wasm() -> PathBuf {
    support::artifacts::with_build_lock(|| {
        let out = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .args(["build", "--release", "--target", "wasm32-wasip1"])
            .args(["--example", "floor_filter"])
            .current_dir(support::repo_root())
            .env("CARGO_TARGET_DIR", support::target_dir())
            .output()
            .expect("running cargo build --example floor_filter");
        assert!(
            out.status.success(),
            "cargo build --example floor_filter: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
    support::target_dir().join("wasm32-wasip1/release/examples/floor_filter.wasm")
}

fn chat(bytes: usize) -> String {
    let content = "x".repeat(bytes);
    json!({"model": "m1", "messages": [{"role": "user", "content": content}]}).to_string()
}

/// One test: the harness takes the module from `COMPUTEFLUX_WASM`, set once for this binary.
#[test]
fn the_floor_routes_every_request_to_its_cluster_and_refuses_no_cluster() {
    std::env::set_var("COMPUTEFLUX_WASM", floor_wasm());
    let a = steady_mock("a", 0);
    let b = steady_mock("b", 0);
    let clusters = [("a", a.port), ("b", b.port)];
    let mut checks = Checks::new();
    let e = Envoy::start(EnvoyConfig::new(json!({"cluster": "b"}), &clusters));

    let small = post_chat(e.port, &[], &chat(300));
    // 1 MiB arrives in many chunks: the module must pause until the end of the stream.
    let large = post_chat(e.port, &[], &chat(1 << 20));
    // A client naming the other cluster is overridden.
    let spoofed = post_chat(e.port, &[("x-computeflux-cluster", "a")], &chat(300));
    // No body: routed from the headers callback.
    let models = get(e.port, "/v1/models");
    let statuses = [small.status, large.status, spoofed.status, models.status];
    println!(
        "statuses {statuses:?}; chats at a {}, at b {}",
        a.request_count(),
        b.request_count()
    );
    checks.expect(
        statuses.iter().all(|s| *s == 200),
        format!("every request answered 200 (got {statuses:?})"),
    );
    let answered_by: Vec<&str> = [&small, &large, &spoofed]
        .iter()
        .map(|r| r.headers.get("x-mock-endpoint").map_or("?", String::as_str))
        .collect();
    checks.expect(
        answered_by.iter().all(|n| *n == "b"),
        format!("every chat answered by the configured cluster's mock (got {answered_by:?})"),
    );
    checks.expect(
        a.request_count() == 0 && b.request_count() == 3,
        format!(
            "chats at the other cluster 0, at the configured one 3 (got {}, {})",
            a.request_count(),
            b.request_count()
        ),
    );
    checks.expect(
        models.body.contains(r#""owned_by":"b""#),
        format!("the request without a body reaches b too: {}", models.body),
    );
    checks.expect(
        e.wasm_crashes().is_empty(),
        format!("no panic in Envoy's log: {:?}", e.wasm_crashes()),
    );

    // Spread over N clusters by session (the fleet benchmark's floor): both clusters take
    // sessions, and a session's requests all reach the same one.
    let c = steady_mock("c", 0);
    let d = steady_mock("d", 0);
    let spread = Envoy::start(EnvoyConfig::new(
        json!({"cluster": "s", "clusters": 2}),
        &[("s0", c.port), ("s1", d.port)],
    ));
    let mut split = Vec::new();
    for k in 0..16 {
        let sid = format!("floor-{k}");
        let ends: Vec<String> = (0..2)
            .map(|_| {
                let r = post_chat(spread.port, &[("x-session-id", sid.as_str())], &chat(100));
                let end = r.headers.get("x-mock-endpoint").cloned();
                end.filter(|_| r.status == 200)
                    .unwrap_or_else(|| "?".into())
            })
            .collect();
        split.push(ends);
    }
    checks.expect(
        split.iter().all(|e| e[0] != "?" && e[0] == e[1]),
        format!("each session's two requests answered by one cluster's mock: {split:?}"),
    );
    checks.expect(
        c.request_count() > 0
            && d.request_count() > 0
            && c.request_count() + d.request_count() == 32,
        format!(
            "sessions spread over both clusters (c {}, d {})",
            c.request_count(),
            d.request_count()
        ),
    );
    checks.expect(
        spread.wasm_crashes().is_empty(),
        format!(
            "no panic in the spreading Envoy's log: {:?}",
            spread.wasm_crashes()
        ),
    );

    let refused = Envoy::try_start(EnvoyConfig::new(json!({"header": "x"}), &clusters));
    checks.expect(
        matches!(&refused, Err(log) if log.contains("floor_filter: configuration needs")),
        "a configuration without a cluster is refused with the module's message",
    );
    checks.finish();
}
