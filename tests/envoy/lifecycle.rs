//! The request lifecycle through a real Envoy (`--concurrency 2`): requests that end with
//! trailers, answers that stream, failover answers too large to relay.
//!
//! Defined behaviour checked here (also in docs/routing.md and docs/hardening.md):
//! - A POST whose body is followed by trailers (HTTP/2 always delivers them; HTTP/1.1 chunked
//!   trailers when the listener sets `http_protocol_options.enable_trailers`, else Envoy drops
//!   them) is routed like any other: the body callback never sees the end of the stream, the
//!   trailers callback completes the body. Failover calls carry the trailers.
//! - An attempt counts as in flight until its answer ends: a streamed (SSE) answer shows in
//!   `computeflux_in_flight` for as long as it streams, and `computeflux_upstream_latency_ms`
//!   still measures the time to its headers. A client gone mid-stream ends the attempt with
//!   the verdict of its headers (a success), not as cancelled.
//! - A failover answer (delivered whole by Envoy) is relayed up to 8 MiB
//!   (`MAX_RELAYED_ANSWER_BYTES`); above, the client gets `502 failover_answer_too_large`.
//!   Past the cluster's `per_connection_buffer_limit_bytes` (16 MiB here) Envoy drains the
//!   answer itself and fails the call without headers: `502 upstream_unavailable`. The test
//!   prints Envoy's RSS around each (run with `--nocapture` to see it).

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::http::{self, Response};
use support::raw::{chunk, h2_request_with_trailers, head, raw_exchange};
use support::{chat_body, Envoy, EnvoyConfig, MockUpstream};

const FAST: [&str; 4] = ["--prefill-us-per-token", "0", "--decode-ms", "0"];
const PATH: &str = "/v1/chat/completions";

/// The value of the Prometheus series `name{labels}` (labels in any order), if present.
fn prom(envoy: &Envoy, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    envoy.prometheus().lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        if n != name {
            return None;
        }
        let got: BTreeMap<String, String> = rest
            .trim_end_matches('}')
            .split(',')
            .filter(|kv| !kv.is_empty())
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_string(), v.trim_matches('"').to_string()))
            })
            .collect();
        (got == want).then(|| value.parse().ok()).flatten()
    })
}

fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn no_panic(envoy: &Envoy) {
    std::thread::sleep(Duration::from_millis(300)); // the log is flushed every 100 ms
    let log = envoy.log_contents();
    assert!(
        !log.to_ascii_lowercase().contains("panic"),
        "panic in Envoy's log:\n{log}"
    );
    assert!(
        !log.contains("Wasm VM failed"),
        "VM failure in Envoy's log:\n{log}"
    );
}

/// The `user` of the last chat request `m` received (the body arrived whole).
fn last_user(m: &MockUpstream) -> Value {
    m.requests()
        .last()
        .map_or(Value::Null, |r| r["user"].clone())
}

fn trailers_envoy(a: &MockUpstream, b: &MockUpstream, enable_trailers: bool) -> Envoy {
    let plugin = json!({
        "endpoints": [{"name": "a", "cluster": "a", "weight": 100}, {"name": "b", "cluster": "b", "weight": 1}],
        "max_attempts": 2,
    });
    let mut cfg = EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port)]);
    if enable_trailers {
        cfg.hcm_extra = json!({"http_protocol_options": {"enable_trailers": true}});
    }
    Envoy::start(cfg)
}

/// A chunked HTTP/1.1 POST of `body` whose last chunk is followed by a trailer field.
fn chunked_with_trailers(port: u16, body: &str) -> support::raw::Raw {
    let mut parts = vec![head(&[b"te: trailers"], "transfer-encoding: chunked")];
    for piece in body.as_bytes().chunks(11) {
        parts.push(chunk(piece));
    }
    parts.push(b"0\r\nx-checksum: abc\r\n\r\n".to_vec());
    raw_exchange(port, &parts, Duration::from_millis(1)).expect("chunked exchange")
}

#[test]
fn requests_with_trailers_are_routed_over_http1_and_http2() {
    let a = MockUpstream::start("a", &[], &FAST);
    let b = MockUpstream::start("b", &[], &FAST);
    let envoy = trailers_envoy(&a, &b, true);
    let port = envoy.port;

    // HTTP/1.1, chunked body, then a trailer field: the filter routes it to a.
    let body = chat_body("m", &["trailers over h1"], json!({"user": "t-h1"}));
    let raw = chunked_with_trailers(port, &body);
    assert_eq!(raw.status, 200, "{raw:?}");
    assert_eq!(raw.header("x-computeflux-endpoint").as_deref(), Some("a"));
    assert_eq!(raw.header("x-mock-endpoint").as_deref(), Some("a"));
    assert_eq!(last_user(&a), "t-h1");

    // HTTP/2: HEADERS, DATA, then HEADERS(trailers, END_STREAM).
    let trailers = [("x-checksum", "abc")];
    let ct = [("content-type", "application/json")];
    let body = chat_body("m", &["trailers over h2"], json!({"user": "t-h2"}));
    let r = h2_request_with_trailers(port, "POST", PATH, &ct, body.as_bytes(), &trailers)
        .expect("h2 with trailers");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("a"));
    assert_eq!(r.header("x-computeflux-attempts"), Some("1"));
    assert_eq!(last_user(&a), "t-h2");

    // ... and fails over: a answers 503 once, the failover call to b carries the body.
    a.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let body = chat_body("m", &["trailers, failover"], json!({"user": "t-fo"}));
    let r = h2_request_with_trailers(port, "POST", PATH, &ct, body.as_bytes(), &trailers)
        .expect("h2 with trailers, failover");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("b"));
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    assert_eq!(last_user(&b), "t-fo");

    // A body completed by trailers is checked like any other.
    let before = a.request_count() + b.request_count();
    let r = h2_request_with_trailers(port, "POST", PATH, &ct, b"{nope", &trailers)
        .expect("h2 bad body with trailers");
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_json");
    let r = h2_request_with_trailers(port, "POST", PATH, &ct, b"", &trailers)
        .expect("h2 trailers without a body");
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "empty_body");
    assert_eq!(a.request_count() + b.request_count(), before);
    no_panic(&envoy);
    drop(envoy);

    // Without enable_trailers (Envoy's default) the HTTP/1.1 codec drops the trailers and the
    // body callback sees the end: routed the same.
    let envoy = trailers_envoy(&a, &b, false);
    let body = chat_body("m", &["trailers dropped"], json!({"user": "t-drop"}));
    let raw = chunked_with_trailers(envoy.port, &body);
    assert_eq!(raw.status, 200, "{raw:?}");
    assert_eq!(raw.header("x-computeflux-endpoint").as_deref(), Some("a"));
    assert_eq!(last_user(&a), "t-drop");
    no_panic(&envoy);
}

/// Sends a streamed chat request on a raw connection and reads until the first SSE event.
fn open_stream(port: u16, session: &str) -> (TcpStream, Vec<u8>) {
    let body = chat_body(
        "m",
        &["stream to me"],
        json!({"stream": true, "user": session}),
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let req = format!(
        "POST {PATH} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before the first event: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    (s, got)
}

#[test]
fn a_streamed_answer_counts_as_in_flight_until_it_ends() {
    // 16 tokens over 10 s: room for the gauge's 1 s refresh to be late by seconds on a loaded
    // machine (a 1.7 s window once missed it in a full parallel run).
    let a = MockUpstream::start(
        "a",
        &[],
        &["--prefill-us-per-token", "0", "--decode-ms", "10000"],
    );
    let plugin = json!({"endpoints": [{"name": "a", "cluster": "a"}]});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("a", a.port)]));
    let in_flight = || prom(&envoy, "computeflux_in_flight", &[("endpoint", "a")]);
    let outcome = |o: &str| {
        prom(
            &envoy,
            "computeflux_requests_total",
            &[("endpoint", "a"), ("outcome", o)],
        )
    };

    let t0 = Instant::now();
    let (mut s, mut got) = open_stream(envoy.port, "sse-1");
    // The gauge is refreshed from the shared table every second.
    assert!(
        eventually(Duration::from_millis(4000), || in_flight() == Some(1.0)),
        "the open stream is not in flight: {:?}",
        in_flight()
    );
    // Still streaming a second later: still in flight (it used to drop to 0 at the headers).
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        t0.elapsed() < Duration::from_millis(9000),
        "the stream ended too early to tell"
    );
    assert_eq!(in_flight(), Some(1.0), "in flight while streaming");
    assert_eq!(
        outcome("success").unwrap_or(0.0),
        0.0,
        "finished before its end"
    );
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("[DONE]") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream cut: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(9000),
        "{:?}",
        t0.elapsed()
    );
    assert!(
        eventually(Duration::from_secs(3), || in_flight() == Some(0.0)),
        "in flight after the end: {:?}",
        in_flight()
    );
    assert_eq!(outcome("success"), Some(1.0));
    // The latency learnt is the time to the headers, not the 10 s of generation.
    let latency = prom(
        &envoy,
        "computeflux_upstream_latency_ms_sum",
        &[("endpoint", "a")],
    );
    assert!(
        latency.is_some_and(|l| l < 1000.0),
        "latency sum {latency:?}"
    );

    // A client gone mid-stream: the attempt ends (in flight 0) with its headers' verdict.
    let (s, _) = open_stream(envoy.port, "sse-2");
    assert!(eventually(Duration::from_millis(4000), || in_flight() == Some(1.0)));
    drop(s);
    assert!(
        eventually(Duration::from_secs(3), || in_flight() == Some(0.0)),
        "in flight after the client left: {:?}",
        in_flight()
    );
    assert_eq!(outcome("success"), Some(2.0));
    assert_eq!(outcome("cancelled").unwrap_or(0.0), 0.0);
    no_panic(&envoy);
}

/// Envoy's resident set size in KiB (Linux `/proc`).
fn rss_kib(envoy: &Envoy) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", envoy.pid())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// `n` requests that fail over from a (503) to b, whose answer is padded with `pad` bytes.
fn failovers(envoy: &Envoy, b: &MockUpstream, pad: usize, n: usize) -> Vec<Response> {
    b.set_fault(json!({"mode": "pad", "bytes": pad}));
    (0..n)
        .map(|i| {
            let body = chat_body("m", &[&format!("big answer {pad} {i}")], Value::Null);
            http::request(
                envoy.port,
                "POST",
                PATH,
                &[],
                Some(body.as_bytes()),
                Duration::from_secs(60),
            )
            .expect("POST")
        })
        .collect()
}

#[test]
fn failover_answers_are_relayed_up_to_the_limit_and_refused_beyond() {
    const MIB: usize = 1024 * 1024;
    const LIMIT: usize = 8 * MIB; // scheduler::flow::MAX_RELAYED_ANSWER_BYTES
    const ENVOY_BUFFER: usize = 16 * MIB; // the clusters' per_connection_buffer_limit_bytes
    let a = MockUpstream::start("a", &[], &FAST);
    let b = MockUpstream::start("b", &[], &FAST);
    a.set_fault(json!({"mode": "status", "status": 503}));
    let plugin = json!({
        "endpoints": [{"name": "a", "cluster": "a", "weight": 100}, {"name": "b", "cluster": "b", "weight": 1}],
        "max_attempts": 2, "failure_threshold": 1000, "tuning": {"retry_budget_min_retries": 1000},
    });
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port)]));
    let warm = failovers(&envoy, &b, 0, 4);
    assert!(warm.iter().all(|r| r.status == 200), "{:?}", warm.first());
    let base = rss_kib(&envoy);

    // Just under the limit: relayed whole (the JSON with its padding).
    let under = LIMIT - 64 * 1024;
    let relayed = failovers(&envoy, &b, under, 4);
    let after_relayed = rss_kib(&envoy);
    // Over the filter's limit, within Envoy's buffer: refused by the filter, never copied.
    let over = 12 * MIB;
    let refused = failovers(&envoy, &b, over, 4);
    let after_refused = rss_kib(&envoy);
    // Over Envoy's own buffer: Envoy drains it and fails the call without headers.
    let huge = 2 * ENVOY_BUFFER;
    let drained = failovers(&envoy, &b, huge, 2);
    let after_drained = rss_kib(&envoy);
    eprintln!(
        "Envoy RSS (KiB): {base} after small failovers; {after_relayed} (+{}) after 4 relayed \
         {:.1} MiB answers; {after_refused} (+{}) after 4 refused {} MiB answers; \
         {after_drained} (+{}) after 2 drained {} MiB answers",
        after_relayed.saturating_sub(base),
        under as f64 / MIB as f64,
        after_refused.saturating_sub(after_relayed),
        over / MIB,
        after_drained.saturating_sub(after_refused),
        huge / MIB,
    );

    for r in &relayed {
        assert_eq!(r.status, 200, "{}", r.body.get(..300).unwrap_or(&r.body));
        assert_eq!(r.header("x-computeflux-endpoint"), Some("b"));
        assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
        let v = r.json();
        assert_eq!(v["x_padding"].as_str().map(str::len), Some(under));
        assert_eq!(v["object"], "chat.completion");
    }
    for r in &refused {
        assert_eq!(r.status, 502, "{}", r.body.get(..300).unwrap_or(&r.body));
        let v = r.json();
        assert_eq!(v["error"]["code"], "failover_answer_too_large", "{v}");
        assert_eq!(v["error"]["type"], "server_error", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&LIMIT.to_string()),
            "{v}"
        );
        assert_eq!(r.header("x-computeflux-endpoint"), Some("b"));
    }
    for r in &drained {
        assert_eq!(r.status, 502, "{}", r.body.get(..300).unwrap_or(&r.body));
        assert_eq!(
            r.json()["error"]["code"],
            "upstream_unavailable",
            "{}",
            r.body
        );
    }
    let rejected = prom(
        &envoy,
        "computeflux_rejected_total",
        &[("reason", "failover_answer_too_large")],
    );
    assert_eq!(rejected, Some(4.0));
    // b did answer the refused ones: successes (4 warm-up, 4 relayed, 4 refused).
    let ok = prom(
        &envoy,
        "computeflux_requests_total",
        &[("endpoint", "b"), ("outcome", "success")],
    );
    assert_eq!(ok, Some(12.0));
    no_panic(&envoy);
}
