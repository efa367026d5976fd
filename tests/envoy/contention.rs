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

use crate::support;

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
    send_on(&mut s, body);
    s
}

/// `n` instant mocks named `<prefix><i>`, all serving `m`, each its own endpoint and cluster,
/// and an Envoy with the filter in front of them.
fn fleet(prefix: &str, n: usize) -> (Vec<MockUpstream>, Envoy) {
    let mocks: Vec<MockUpstream> = (0..n)
        .map(|i| {
            MockUpstream::start(
                &format!("{prefix}{i}"),
                &["m"],
                &["--prefill-us-per-token", "0", "--decode-ms", "0"],
            )
        })
        .collect();
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
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
    (mocks, envoy)
}

#[test]
fn in_flight_counts_are_exact_with_both_workers_busy() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 50;
    const HELD: usize = 24;
    let (mocks, envoy) = fleet("e", ENDPOINTS);
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

/// Sends a chat request on an open connection and leaves the answer unread.
fn send_on(s: &mut TcpStream, body: &str) {
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body.as_bytes()).expect("write body");
}

/// Opens connections until one of Envoy's two workers holds at least `most` and the other at
/// least `least`, found by the worker whose accepted-connection count grew; the larger pool
/// first.
fn connections_by_worker(envoy: &Envoy, most: usize, least: usize) -> Vec<Vec<TcpStream>> {
    let mut by: BTreeMap<String, Vec<TcpStream>> = BTreeMap::new();
    let mut before = worker_connections(envoy);
    let enough = |by: &BTreeMap<String, Vec<TcpStream>>| {
        let mut lens: Vec<usize> = by.values().map(Vec::len).collect();
        lens.sort_unstable();
        lens.len() == 2 && lens[1] >= most && lens[0] >= least
    };
    for _ in 0..(4 * most + 64) {
        if enough(&by) {
            break;
        }
        let s = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect to Envoy");
        let mut grown = None;
        assert!(
            eventually(Duration::from_secs(5), || {
                let now = worker_connections(envoy);
                grown = now
                    .iter()
                    .find(|(w, n)| before.get(*w).copied().unwrap_or(0) < **n)
                    .map(|(w, _)| w.clone());
                before = now;
                grown.is_some()
            }),
            "a connection accepted by no worker"
        );
        by.entry(grown.unwrap()).or_default().push(s);
    }
    assert!(
        enough(&by),
        "connections by worker: {:?}",
        by.iter().map(|(w, v)| (w, v.len())).collect::<Vec<_>>()
    );
    let mut pools: Vec<Vec<TcpStream>> = by.into_values().collect();
    pools.sort_by_key(|p| std::cmp::Reverse(p.len()));
    pools
}

/// The split table under both workers (issue 21): a worker reads the header, then only the
/// groups (16 entries each; 24 endpoints are two groups) whose version another write moved
/// since it last read them, and decodes only their entries whose stamp moved. Either way its
/// next write must start from the other worker's updates. Worker B reads the table after
/// worker A held a few requests, then after A held many more (70 writes: more than the write
/// log of `TABLE_VERSION` 14 held), each time holding a request of its own: if B's view missed
/// one of A's writes, its write would put back an older in-flight count and the gauges would
/// count fewer requests than are held.
#[test]
fn in_flight_counts_are_exact_through_group_versions() {
    const N: usize = 24;
    const ROUNDS: usize = 6;
    const PER_ROUND: usize = 10;
    /// More single-entry writes than the former write log held (64).
    const PAST_LOG: usize = 70;
    const B_PAST: usize = 4;
    let (mocks, envoy) = fleet("w", N);
    let port = envoy.port;
    // Both workers read and write the table first (fresh connections land on either).
    for k in 0..16 {
        let r = post_chat(port, &[], &body(&format!("log-warm-{k}")));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let mut pools =
        connections_by_worker(&envoy, ROUNDS * PER_ROUND + PAST_LOG, ROUNDS + 1 + B_PAST);
    let (mut a, mut b) = (pools.remove(0), pools.remove(0));
    for m in &mocks {
        m.set_fault(json!({"mode": "hang"}));
    }
    let mut held: Vec<TcpStream> = Vec::new();
    let hold = |pool: &mut Vec<TcpStream>, tag: String, held: &mut Vec<TcpStream>| {
        let mut s = pool.pop().expect("a connection left");
        send_on(&mut s, &body(&tag));
        held.push(s);
    };
    let counted = |want: usize| {
        eventually(Duration::from_secs(10), || {
            prom_sum(&envoy, "computeflux_in_flight") == want as f64
        })
    };
    // B holds one (its view is current), then reads through the log after each of A's rounds.
    hold(&mut b, "log-b-0".into(), &mut held);
    assert!(counted(held.len()), "B's first hold");
    for round in 0..ROUNDS {
        for k in 0..PER_ROUND {
            hold(&mut a, format!("log-a-{round}-{k}"), &mut held);
        }
        assert!(counted(held.len()), "A's round {round}");
        hold(&mut b, format!("log-b-{}", round + 1), &mut held);
        assert!(
            counted(held.len()),
            "through the log, round {round}: in-flight {} for {} held",
            prom_sum(&envoy, "computeflux_in_flight"),
            held.len()
        );
    }
    // Past the log: A writes more than it holds before B reads again.
    for k in 0..PAST_LOG {
        hold(&mut a, format!("log-a-past-{k}"), &mut held);
    }
    assert!(counted(held.len()), "A past the log");
    for k in 0..B_PAST {
        hold(&mut b, format!("log-b-past-{k}"), &mut held);
    }
    assert!(
        counted(held.len()),
        "past the log: in-flight {} for {} held",
        prom_sum(&envoy, "computeflux_in_flight"),
        held.len()
    );
    drop(held);
    assert!(
        eventually(Duration::from_secs(10), || prom_sum(
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
