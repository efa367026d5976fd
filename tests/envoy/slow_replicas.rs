//! A slowed engine judged by three Envoy replicas without engine metrics, through real Envoys
//! (1.40) and engine-like mocks.
//!
//! Covered: each replica judges an engine degraded from its own answers alone, and each sees a
//! third of them. The streams' decode phases are what judges an engine (a queue cannot touch
//! them); they are judged against the requested model's decode rate, which a few streams
//! measure. A replica that had not yet counted `MODEL_WARM_SAMPLES` (32) answers of the model
//! judged nothing — with three replicas, a model with a quarter of the traffic was that cold
//! 22–30 s into the Zipf bench's `slow` run, and the slowed engine kept its sessions meanwhile.

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
/// Streamed answers of this many tokens: 47 decode tokens each, so that a few streams measure
/// the model's decode rate (256 tokens), and a running stream's pace is checked once.
const MAX_TOKENS: u64 = 48;
/// One-turn sessions per replica before the slowdown: each replica's endpoints get a few
/// answers (past `cold_start_samples`), and its model fewer than the 32 answers of a warm fit.
const WARM_PER_REPLICA: usize = 15;
/// Sessions homed on `a` that keep talking after its slowdown: two later turns per replica a
/// round.
const ON_A: usize = 2 * REPLICAS;
/// Later turns of those sessions per replica after the slowdown, at most: each replica's
/// answers stay below 32 (15 + 16 = 31).
const TURNS_PER_REPLICA: usize = 16;

fn plugin() -> Value {
    let endpoints: Vec<Value> = NAMES
        .iter()
        .map(|n| json!({"name": n, "cluster": n}))
        .collect();
    json!({"endpoints": endpoints, "cold_start_samples": 3})
}

fn streamed() -> Value {
    json!({"stream": true, "max_tokens": MAX_TOKENS})
}

fn degraded_on(replicas: &Replicas, r: usize) -> bool {
    replicas
        .envoy(r)
        .computeflux_stats()
        .get("wasmcustom.computeflux_degraded.endpoint.a")
        .copied()
        == Some(1)
}

/// Three replicas, no engine metrics, `a` turned 5× slower once every replica has seen
/// `WARM_PER_REPLICA` streamed answers: the later turns of the sessions homed on `a` (one
/// replica after another, no cookies kept) make every replica judge `a` degraded before it has
/// counted 32 answers of the model. Before the rule, no replica judged it at all.
#[test]
fn replicas_judge_a_slowed_engine_by_its_streams_before_their_model_is_warm() {
    let mocks: Vec<MockUpstream> = NAMES
        .iter()
        .map(|n| MockUpstream::paced_engine(n, &[MODEL]))
        .collect();
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let replicas = Replicas::start(EnvoyConfig::new(plugin(), &clusters), REPLICAS);
    let ports: Vec<u16> = (0..REPLICAS).map(|r| replicas.port(r)).collect();

    let mut warm = Session::many("warm", WARM_PER_REPLICA * REPLICAS, MODEL);
    for_each_parallel(&mut warm, REPLICAS, |i, s| {
        let r = i % REPLICAS;
        s.send_with(r, ports[r], streamed());
    });
    assert!(warm.iter().all(|s| s.turns[0].ok()), "warm-up failed");
    let mut on_a: Vec<Session> = warm
        .into_iter()
        .filter(|s| s.first_endpoint() == Some("a"))
        .collect();
    assert!(
        on_a.len() >= ON_A,
        "only {} sessions homed on a: too few to judge it",
        on_a.len()
    );
    on_a.truncate(ON_A);

    mocks[0].set_fault(json!({"mode": "slow", "factor": 5}));
    let mut sent = [0usize; REPLICAS];
    let mut judged: [Option<usize>; REPLICAS] = [None; REPLICAS];
    let mut round = 0;
    while judged.iter().any(Option::is_none) && sent.iter().all(|n| *n < TURNS_PER_REPLICA) {
        // Each session's next turn through the next replica; one request per replica at a time.
        for_each_parallel(&mut on_a, REPLICAS, |i, s| {
            let r = (i + round) % REPLICAS;
            s.send_with(r, ports[r], streamed());
        });
        for (i, s) in on_a.iter().enumerate() {
            assert!(s.turns.last().unwrap().ok(), "{}", s.trail());
            sent[(i + round) % REPLICAS] += 1;
        }
        round += 1;
        // The gauges follow the shared table once a second.
        let until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < until && judged.iter().any(Option::is_none) {
            for (r, j) in judged.iter_mut().enumerate() {
                if j.is_none() && degraded_on(&replicas, r) {
                    *j = Some(sent[r]);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let trails: Vec<String> = on_a.iter().map(Session::trail).collect();
    assert!(
        judged.iter().all(Option::is_some),
        "a judged degraded by replicas {judged:?} after {sent:?} of its sessions' later turns \
         (each replica below 32 answers of the model): {trails:#?}"
    );
    eprintln!("a judged degraded after {judged:?} of its later turns per replica");
    let crashes = replicas.wasm_crashes();
    assert!(crashes.is_empty(), "{crashes:?}");
}
