//! A degraded engine's probes with several Envoy replicas, through real Envoys (1.40) and
//! engine-like mocks whose `/metrics` publish their decode counters (vLLM format).
//!
//! Covered: three replicas that judge an engine degraded by its published pace probe it about
//! as often as one Envoy would — the probe interval doubles after every probe of the fleet, as
//! the engine's decoding shows them to every replica alike (`placement::fleet_probes`), not
//! after each replica's own probes alone (then every replica that had not probed yet waited
//! the base interval after the others' probes: one probe per base interval and probe length).

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{for_each_parallel, EnvoyConfig, MockUpstream, Replicas, Session};

const MODEL: &str = "m1";
const NAMES: [&str; 3] = ["a", "b", "c"];
const REPLICAS: usize = 3;
/// The base probe interval: short against a probe's length on the slowed engine (≈ 1 s), so
/// that probing per replica and probing per fleet differ by far.
const PROBE_INTERVAL_MS: u64 = 150;
/// Output tokens per request: a pace window (32 tokens) closes with every answer.
const MAX_TOKENS: u64 = 48;
/// How long new sessions keep arriving once every replica judged `a` degraded.
const WATCHED: Duration = Duration::from_secs(15);
const WAIT: Duration = Duration::from_secs(20);

fn plugin() -> Value {
    let metrics = json!({"format": "vllm", "interval_ms": 100, "timeout_ms": 1000});
    let endpoints: Vec<Value> = NAMES
        .iter()
        .map(|n| json!({"name": n, "cluster": n, "metrics": metrics}))
        .collect();
    json!({
        "endpoints": endpoints,
        "cold_start_samples": 5,
        "tuning": {
            "degraded_probe_interval_ms": PROBE_INTERVAL_MS,
            "degraded_probe_max_interval_ms": 60_000
        }
    })
}

/// One turn of each of `count` new sessions `tag-k`, round robin over the replicas from four
/// clients; the sessions with their turn.
fn new_sessions(replicas: &Replicas, tag: &str, from: usize, count: usize) -> Vec<Session> {
    let mut sessions: Vec<Session> = (from..from + count)
        .map(|k| Session::new(format!("{tag}-{k}"), MODEL))
        .collect();
    let ports: Vec<u16> = (0..replicas.len()).map(|r| replicas.port(r)).collect();
    for_each_parallel(&mut sessions, 4, |i, s| {
        let r = (from + i) % ports.len();
        s.send_with(r, ports[r], json!({"max_tokens": MAX_TOKENS}));
    });
    sessions
}

fn degraded_everywhere(replicas: &Replicas) -> bool {
    replicas.envoys().iter().all(|e| {
        e.computeflux_stats()
            .get("wasmcustom.computeflux_degraded.endpoint.a")
            .copied()
            == Some(1)
    })
}

/// Three replicas, `a` turned 5× slower (its published pace too) and judged degraded by each:
/// over the next 15 s of new sessions (four clients, round robin over the replicas), `a` gets
/// no more of them than one prober's schedule allows — `⌊log2(15 s ÷ 150 ms + 1)⌋` = 6 probes
/// (5 with the probes' lengths), plus one for what each replica may count late — where probing
/// per replica gives one per base interval and probe length (≈ 1.3 s: about 11).
#[test]
fn replicas_probe_a_degraded_engine_as_one_envoy_would() {
    let mocks: Vec<MockUpstream> = NAMES
        .iter()
        .map(|n| MockUpstream::paced_engine(n, &[MODEL]))
        .collect();
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let replicas = Replicas::start(EnvoyConfig::new(plugin(), &clusters), REPLICAS);

    // Every engine decodes (its pace known to every replica), then `a` turns 5× slower.
    let warm = new_sessions(&replicas, "warm", 0, 30);
    assert!(warm.iter().all(|s| s.turns[0].ok()), "warm-up failed");
    mocks[0].set_fault(json!({"mode": "slow", "factor": 5}));
    let deadline = Instant::now() + WAIT;
    let mut n = 0;
    while !degraded_everywhere(&replicas) {
        assert!(
            Instant::now() < deadline,
            "a not judged degraded by every replica in {WAIT:?}"
        );
        new_sessions(&replicas, "judge", n, 6);
        n += 6;
    }

    // New sessions for 15 s: those `a` served are its probes.
    let started = Instant::now();
    let mut served = Vec::new();
    let mut k = 0;
    while started.elapsed() < WATCHED {
        for s in new_sessions(&replicas, "watch", k, 12) {
            let t = &s.turns[0];
            assert!(t.ok(), "{}", s.trail());
            if t.endpoint() == "a" {
                served.push(s.trail());
            }
        }
        k += 12;
    }
    let schedule = (WATCHED.as_millis() as u64 / PROBE_INTERVAL_MS + 1).ilog2() as usize;
    assert!(
        served.len() <= schedule + 1,
        "a served {} of {k} new sessions in {WATCHED:?} (one prober's schedule: {schedule}): \
         {served:?}",
        served.len()
    );
    eprintln!(
        "probes: a served {} of {k} new sessions in {WATCHED:?}",
        served.len()
    );
    let crashes = replicas.wasm_crashes();
    assert!(crashes.is_empty(), "{crashes:?}");
}
