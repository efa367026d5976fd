#![cfg(not(target_arch = "wasm32"))]
// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]
//! The endpoint table under both Envoy workers busy (issue 21): no lost updates.
//!
//! Why: a request rewrites only its endpoint's entry in a copy of the stored table, and each
//! worker VM decodes only the entries whose write stamp moved since it last read the table
//! (`table::TableCache`). Both are shortcuts over one CAS-protected value: if either let a
//! worker write from a stale view, an in-flight increment or decrement made by the other
//! worker would be lost. Here eight clients keep both workers of a real Envoy
//! (`--concurrency 2`) picking and finishing attempts on eight endpoints at once, then hold
//! requests open: the in-flight gauges (mirrors of the shared table, refreshed every second)
//! must count exactly the requests held, and return to zero.

mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

const ENDPOINTS: usize = 8;

/// Sum of a Prometheus metric over its series (0 when there is none).
fn prom_sum(envoy: &Envoy, name: &str) -> f64 {
    envoy
        .prometheus()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Connections accepted by each of Envoy's workers so far.
fn worker_connections(envoy: &Envoy) -> BTreeMap<String, i64> {
    envoy
        .admin_get("/stats")
        .body
        .lines()
        .filter(|l| l.contains(".worker_") && l.contains(".downstream_cx_total:"))
        .filter_map(|l| {
            let (name, v) = l.split_once(": ")?;
            let worker = name.split('.').find(|p| p.starts_with("worker_"))?;
            Some((worker.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A fresh conversation (its own session), so requests spread over every endpoint.
fn body(tag: &str) -> String {
    chat_body(
        "m",
        &[&format!(
            "contention {tag} of process {}",
            std::process::id()
        )],
        Value::Null,
    )
}

/// A chat request on its own connection (so it may land on either worker), left unread.
fn raw_request(port: u16, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to Envoy");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body.as_bytes()).expect("write body");
    s
}

#[test]
fn in_flight_counts_are_exact_with_both_workers_busy() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 50;
    const HELD: usize = 24;
    let mocks: Vec<MockUpstream> = (0..ENDPOINTS)
        .map(|i| {
            MockUpstream::start(
                &format!("e{i}"),
                &["m"],
                &["--prefill-us-per-token", "0", "--decode-ms", "0"],
            )
        })
        .collect();
    let names: Vec<String> = (0..ENDPOINTS).map(|i| format!("e{i}")).collect();
    let endpoints: Vec<Value> = names
        .iter()
        .map(|n| json!({"name": n, "cluster": n, "models": ["m"]}))
        .collect();
    let clusters: Vec<(&str, u16)> = names
        .iter()
        .zip(&mocks)
        .map(|(n, m)| (n.as_str(), m.port))
        .collect();
    let envoy = Envoy::start(EnvoyConfig::new(json!({"endpoints": endpoints}), &clusters));
    let port = envoy.port;

    // Phase 1: both workers picking and finishing at once, every request on a new connection.
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                for k in 0..PER_THREAD {
                    let r = post_chat(port, &[], &body(&format!("{t}-{k}")));
                    assert_eq!(r.status, 200, "{}", r.body);
                }
            });
        }
    });
    let total = THREADS * PER_THREAD;
    let served: i64 = mocks
        .iter()
        .map(|m| m.stats()["status_counts"]["200"].as_i64().unwrap_or(0))
        .sum();
    assert_eq!(served, total as i64, "each request served exactly once");
    let workers = worker_connections(&envoy);
    assert!(
        workers.len() == 2 && workers.values().all(|&n| n > 0),
        "both workers must have served: {workers:?}"
    );
    assert!(
        eventually(Duration::from_secs(5), || prom_sum(
            &envoy,
            "computeflux_in_flight"
        ) == 0.0),
        "in-flight counts left after every request finished: {}",
        prom_sum(&envoy, "computeflux_in_flight")
    );
    let used = mocks
        .iter()
        .filter(|m| m.stats()["status_counts"]["200"].as_i64().unwrap_or(0) > 0)
        .count();
    assert!(
        used >= ENDPOINTS / 2,
        "sessions spread: {used} endpoints used"
    );

    // Phase 2: requests held open on every endpoint: the table counts each exactly once.
    for m in &mocks {
        m.set_fault(json!({"mode": "hang"}));
    }
    let held: Vec<TcpStream> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..HELD)
            .map(|k| s.spawn(move || raw_request(port, &body(&format!("held-{k}")))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        eventually(Duration::from_secs(5), || prom_sum(
            &envoy,
            "computeflux_in_flight"
        ) == HELD as f64),
        "in-flight should count the {HELD} held requests exactly, got {}",
        prom_sum(&envoy, "computeflux_in_flight")
    );
    drop(held);
    assert!(
        eventually(Duration::from_secs(5), || prom_sum(
            &envoy,
            "computeflux_in_flight"
        ) == 0.0),
        "in-flight leaked after the held requests ended: {}",
        prom_sum(&envoy, "computeflux_in_flight")
    );
    for m in &mocks {
        m.clear_fault();
    }
    let log = envoy.log_contents();
    assert!(!log.contains("panic"), "wasm panic in the Envoy log");
    assert!(
        !log.contains("CAS retries exhausted"),
        "a CAS retry loop gave up"
    );
}
