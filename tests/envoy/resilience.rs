// Test helpers fail loudly (panic with context): that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]
//! Resilience under faults, end to end: a real Envoy (several worker threads) running the filter in
//! front of `mock_upstream` processes (tests/tools) whose faults are switched on and off by the tests.
//!
//! Why: the breaker, its bounded half-open probes, Retry-After handling, failover and the retry
//! budget are only worth something if they hold across Envoy's worker threads (shared data, CAS)
//! and against real sockets that refuse, reset and hang. Each test counts requests *at the
//! upstreams* and reads the filter's Prometheus metrics, so a broken implementation fails it.
//!
//! One test per behaviour of issue 4:
//! 1. [`breaker_lifecycle_with_bounded_probes_across_workers`]
//! 2. [`rate_limit_opens_at_once_for_the_hint_and_recovers_by_single_probes`]
//! 3. [`dead_keys_are_skipped_per_request_and_lower_the_score`]
//! 4. [`failover_kinds_bounds_final_response_disconnects_and_streaming`]
//! 5. [`retry_budget_passes_failures_through_when_spent`]
//! 6. [`no_endpoint_left_answers_at_once_with_earliest_retry_after`]
//!
//! Streaming rule (tested in 4): with `"stream": true`, a failure *before the first byte* (5xx,
//! 401/403/429, connect failure, reset, timeout before response headers) fails over exactly like
//! a non-streamed request, and the failed-over answer reaches the client fully buffered (all SSE
//! events at once). Once response headers with a success status have been passed on, bytes are
//! on their way to the client and the attempt is recorded as a success: a failure after that
//! (the upstream dropping the connection mid-stream) is passed through as is — the client sees
//! the stream cut short (no `[DONE]`), no other endpoint is tried, nothing is replayed.
//!
//! Timing: cooldowns are 0.7–3 s so the file runs in well under a minute; assertions that depend
//! on a phase finishing inside a cooldown check that premise and say so if the machine was too
//! slow. Every request body is unique (a fresh conversation), so affinity pins never steer
//! these requests.

use crate::support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use support::http::Response;
use support::{chat_body, placement, post_chat, Envoy, EnvoyConfig, MockUpstream};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const H_ENDPOINT: &str = "x-computeflux-endpoint";
const H_ATTEMPTS: &str = "x-computeflux-attempts";

/// A mock with no simulated latency (answers in about a millisecond).
fn fast_mock(name: &str, models: &[&str]) -> MockUpstream {
    MockUpstream::start(
        name,
        models,
        &["--prefill-us-per-token", "0", "--decode-ms", "0"],
    )
}

fn endpoint(name: &str, weight: f64, models: &[&str]) -> Value {
    json!({"name": name, "cluster": name, "weight": weight, "models": models})
}

/// `e` with an API key of its own (`authorization`): its 401/403 are a dead key (issue 22).
fn keyed(mut e: Value) -> Value {
    let key = format!("Bearer key-{}", e["name"].as_str().unwrap_or(""));
    e["headers"] = json!({ "authorization": key });
    e
}

/// The fleets this file configures: (name, weight, models) of each endpoint.
const FLEETS: &[&[(&str, f64, &[&str])]] = &[
    &[("a", 2.0, &["m"]), ("b", 1.0, &["m"])],
    &[("a", 3.0, &["m"]), ("b", 1.0, &["m"])],
    &[
        ("a", 4.0, &["m", "m2"]),
        ("b", 3.0, &["m", "m2"]),
        ("c", 2.0, &["m"]),
        ("d", 1.0, &["m"]),
    ],
    &[
        ("a", 2.0, &["m1"]),
        ("b", 1.0, &["m1"]),
        ("c", 2.0, &["m2"]),
        ("d", 1.0, &["m2"]),
    ],
];

/// A fresh conversation for `model` (its fingerprint, hence its session, is new) whose
/// rendezvous order, in every fleet of this file, is the endpoints serving `model` by
/// descending weight: while endpoints are healthy the filter tries the heaviest first, then the
/// next, which is what these tests count on. (Placement sends a session to the endpoints in its
/// own weighted rendezvous order; a random session would start elsewhere with odds
/// `w / Σw`.)
fn fresh_body(model: &str, extra: Value) -> String {
    fresh_body_where(model, extra, |session| {
        FLEETS.iter().all(|fleet| {
            let mut serving: Vec<(&str, f64)> = fleet
                .iter()
                .filter(|(_, _, models)| models.contains(&model))
                .map(|(n, w, _)| (*n, *w))
                .collect();
            let by_weight: Vec<&str> = {
                serving.sort_by(|x, y| y.1.total_cmp(&x.1));
                serving.iter().map(|(n, _)| *n).collect()
            };
            placement::rendezvous_order(session, &serving) == by_weight
        })
    })
}

/// A fresh conversation for `model` whose session satisfies `wanted` (see `support::placement`).
fn fresh_body_where(model: &str, extra: Value, wanted: impl Fn(u64) -> bool) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    for _ in 0..100_000 {
        let n = N.fetch_add(1, Ordering::SeqCst);
        let body = chat_body(
            model,
            &[&format!(
                "resilience request {n} of process {}",
                std::process::id()
            )],
            extra.clone(),
        );
        if wanted(placement::body_session(&body)) {
            return body;
        }
    }
    panic!("no conversation found with the wanted rendezvous order");
}

fn chat(envoy: &Envoy, model: &str) -> Response {
    post_chat(envoy.port, &[], &fresh_body(model, Value::Null))
}

/// Asserts status, serving endpoint and attempt count of a response through the filter.
#[track_caller]
fn assert_served(r: &Response, status: u16, endpoint: &str, attempts: u32) {
    let got = (
        r.status,
        r.header(H_ENDPOINT).unwrap_or("-"),
        r.header(H_ATTEMPTS).unwrap_or("-"),
    );
    assert_eq!(
        got,
        (status, endpoint, attempts.to_string().as_str()),
        "(status, endpoint, attempts) mismatch; body: {}",
        r.body
    );
}

/// Parsed `/stats/prometheus` text.
struct Prom(String);

impl Prom {
    fn of(envoy: &Envoy) -> Prom {
        Prom(envoy.prometheus())
    }

    /// Series of `name` whose labels include all of `labels`, with their values.
    fn series(&self, name: &str, labels: &[(&str, &str)]) -> Vec<(BTreeMap<String, String>, f64)> {
        let mut out = Vec::new();
        for line in self.0.lines() {
            if line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let (n, lbl) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                continue;
            }
            let map: BTreeMap<String, String> = lbl
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect();
            if labels
                .iter()
                .all(|(k, v)| map.get(*k).map(String::as_str) == Some(*v))
            {
                out.push((map, value.parse().unwrap_or(f64::NAN)));
            }
        }
        out
    }

    /// Sum over the matching series (0 when there is none).
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.series(name, labels).iter().map(|(_, v)| v).sum()
    }
}

fn metric(envoy: &Envoy, name: &str, labels: &[(&str, &str)]) -> f64 {
    Prom::of(envoy).sum(name, labels)
}

fn breaker_state(envoy: &Envoy, ep: &str) -> f64 {
    metric(envoy, "computeflux_breaker_state", &[("endpoint", ep)])
}

fn outcomes(envoy: &Envoy, ep: &str, outcome: &str) -> f64 {
    metric(
        envoy,
        "computeflux_requests_total",
        &[("endpoint", ep), ("outcome", outcome)],
    )
}

/// Polls `f` every 50 ms until it holds or `limit` passes; returns whether it held.
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

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// `threads` clients, each sending fresh requests for `model` with `gap` between them, until
/// `until` (a request in flight at `until` completes). New connection per request, so the
/// requests land on all of Envoy's workers.
fn burst(
    envoy: &Envoy,
    model: &str,
    threads: usize,
    gap: Duration,
    until: Instant,
) -> Vec<Response> {
    let port = envoy.port;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    while Instant::now() < until {
                        out.push(post_chat(port, &[], &fresh_body(model, Value::Null)));
                        std::thread::sleep(gap);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

fn served_by<'a>(rs: &'a [Response], ep: &str) -> Vec<&'a Response> {
    rs.iter()
        .filter(|r| r.header(H_ENDPOINT) == Some(ep))
        .collect()
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

/// Sends a chat request on a raw connection and returns it unread (for disconnect tests).
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

fn mock_status(status: u16) -> Value {
    json!({"mode": "status", "status": status})
}

// ---------------------------------------------------------------------------------------------
// 1. Breaker lifecycle
// ---------------------------------------------------------------------------------------------

/// Consecutive 5xx open the breaker for `open_ms`; while open the endpoint gets nothing; after
/// the cooldown exactly `half_open_probes` requests reach it although ~hundreds arrive in
/// parallel on all four workers; successful probes close it (full traffic again); a failing
/// probe re-opens it with the cooldown counted from that failure.
#[test]
fn breaker_lifecycle_with_bounded_probes_across_workers() {
    const OPEN_MS: u64 = 1500;
    let a = fast_mock("a", &["m"]);
    let b = fast_mock("b", &["m"]);
    let mut cfg = EnvoyConfig::new(
        json!({
            "endpoints": [endpoint("a", 2.0, &["m"]), endpoint("b", 1.0, &["m"])],
            "failure_threshold": 3,
            "open_ms": OPEN_MS,
            "half_open_probes": 2,
            // Scores stay equal to the weights: a (2) is always preferred while admitted.
            "cold_start_samples": 1_000_000,
            "max_attempts": 2,
            "tuning": {"retry_budget_min_retries": 1000},
        }),
        &[("a", a.port), ("b", b.port)],
    );
    cfg.concurrency = 4;
    let envoy = Envoy::start(cfg);
    let ms = Duration::from_millis;

    // Closed: a takes all traffic.
    for _ in 0..3 {
        assert_served(&chat(&envoy, "m"), 200, "a", 1);
    }
    // Three consecutive 503 open it; each of those requests is rescued by b.
    a.set_fault(mock_status(503));
    for i in 0..3 {
        assert_served(&chat(&envoy, "m"), 200, "b", 2);
        if i < 2 {
            assert_eq!(breaker_state(&envoy, "a"), 0.0, "opened before 3 failures");
        }
    }
    let opened = Instant::now();
    assert_eq!(
        breaker_state(&envoy, "a"),
        1.0,
        "3 consecutive 503 must open"
    );
    assert_eq!(a.request_count(), 6);
    assert_eq!(outcomes(&envoy, "a", "endpoint_failure"), 3.0);

    // Open: parallel traffic on all workers, none of it reaches a.
    let rs = burst(&envoy, "m", 4, ms(20), opened + ms(OPEN_MS - 500));
    assert!(
        Instant::now() < opened + ms(OPEN_MS),
        "premise: the open-phase burst must end within the cooldown (machine too slow?)"
    );
    assert!(
        rs.len() >= 20,
        "only {} requests in the open phase",
        rs.len()
    );
    for r in &rs {
        assert_served(r, 200, "b", 1);
    }
    assert_eq!(a.request_count(), 6, "an open endpoint received traffic");

    // Cooldown over: probes are slow (1 s), so they are outstanding while the burst runs.
    a.set_fault(json!({"mode": "delay_ms", "ms": 1000}));
    sleep_until(opened + ms(OPEN_MS + 200));
    let workers_before = worker_connections(&envoy);
    let burst_start = Instant::now();
    let rs = burst(&envoy, "m", 8, ms(25), burst_start + ms(700));
    let workers_after = worker_connections(&envoy);
    assert_eq!(workers_after.len(), 4, "{workers_after:?}");
    for (w, n) in &workers_after {
        let before = workers_before.get(w).copied().unwrap_or(0);
        assert!(*n > before, "worker {w} got no connection in the burst");
    }
    let probes = served_by(&rs, "a");
    assert_eq!(
        probes.len(),
        2,
        "exactly half_open_probes requests must reach a ({} requests in the burst)",
        rs.len()
    );
    assert!(rs.len() >= 50, "only {} requests in the burst", rs.len());
    for r in &rs {
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header(H_ATTEMPTS), Some("1"));
    }
    assert_eq!(a.request_count(), 8, "probes counted at the upstream");
    assert_eq!(
        metric(
            &envoy,
            "computeflux_decisions_total",
            &[("reason", "half_open_probe")]
        ),
        2.0
    );
    // Both probes succeeded: closed, and a takes full traffic again.
    assert_eq!(breaker_state(&envoy, "a"), 0.0);
    a.clear_fault();
    for _ in 0..5 {
        assert_served(&chat(&envoy, "m"), 200, "a", 1);
    }
    assert_eq!(a.request_count(), 13);

    // Open again, then a failing probe: re-opened with the cooldown counted from the probe.
    a.set_fault(mock_status(503));
    for _ in 0..3 {
        assert_served(&chat(&envoy, "m"), 200, "b", 2);
    }
    let opened = Instant::now();
    assert_eq!(breaker_state(&envoy, "a"), 1.0);
    sleep_until(opened + ms(OPEN_MS + 200));
    assert_served(&chat(&envoy, "m"), 200, "b", 2); // the probe got a 503
    let probe_failed = Instant::now();
    assert_eq!(a.request_count(), 17);
    assert_eq!(
        breaker_state(&envoy, "a"),
        1.0,
        "a failing probe must re-open"
    );
    // With the breaker still half-open the second probe slot would be used here; with the old
    // cooldown it would be half-open already. Neither may happen.
    let rs = burst(&envoy, "m", 4, ms(20), probe_failed + ms(OPEN_MS - 400));
    assert!(
        Instant::now() < probe_failed + ms(OPEN_MS),
        "premise: the burst must end within the new cooldown (machine too slow?)"
    );
    for r in &rs {
        assert_served(r, 200, "b", 1);
    }
    assert_eq!(
        a.request_count(),
        17,
        "a re-opened endpoint received traffic"
    );
    // After the new cooldown it is probed again; two good probes close it.
    a.clear_fault();
    sleep_until(probe_failed + ms(OPEN_MS + 200));
    assert_served(&chat(&envoy, "m"), 200, "a", 1);
    // One of two probes done: still half-open (the gauge shows it from the next 1 s tick).
    assert!(eventually(Duration::from_millis(1500), || breaker_state(
        &envoy, "a"
    ) == 2.0));
    assert_served(&chat(&envoy, "m"), 200, "a", 1);
    assert_eq!(breaker_state(&envoy, "a"), 0.0);
    assert_eq!(a.request_count(), 19);
}

// ---------------------------------------------------------------------------------------------
// 2. 429 is not 503
// ---------------------------------------------------------------------------------------------

/// Sends one request that gets `fault` (a 429, once) from a and is rescued by b, then polls
/// every 50 ms until a request is served by a again. Returns the time from sending the first
/// request to a serving again. Panics if a receives anything before that.
fn measure_rate_limit_cooldown(envoy: &Envoy, a: &MockUpstream, fault: Value) -> Duration {
    let mut fault = fault;
    fault["count"] = json!(1);
    a.set_fault(fault.clone());
    let before = a.request_count();
    let t0 = Instant::now();
    assert_served(&chat(envoy, "m"), 200, "b", 2);
    assert_eq!(a.request_count(), before + 1);
    assert_eq!(
        breaker_state(envoy, "a"),
        1.0,
        "one 429 must open ({fault})"
    );
    loop {
        let r = chat(envoy, "m");
        let elapsed = t0.elapsed();
        if r.header(H_ENDPOINT) == Some("a") {
            assert_served(&r, 200, "a", 1);
            assert_eq!(a.request_count(), before + 2);
            return elapsed;
        }
        assert_served(&r, 200, "b", 1);
        assert_eq!(a.request_count(), before + 1, "a retried during its window");
        assert!(
            elapsed < Duration::from_secs(8),
            "a never came back ({fault})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[track_caller]
fn assert_between(what: &str, got: Duration, lo_ms: u64, hi_ms: u64) {
    // 10 ms below: Envoy's clock has millisecond resolution and is read a bit after ours.
    let ms = got.as_millis() as u64;
    assert!(
        (lo_ms.saturating_sub(10)..=hi_ms).contains(&ms),
        "{what}: cooldown {ms} ms, expected {lo_ms}..={hi_ms}"
    );
}

/// An HTTP-date `secs` seconds from now (whole seconds, as the header carries).
fn http_date_in(secs: u64) -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        + secs;
    let days = t / 86_400;
    let (h, m, s) = ((t / 3600) % 24, (t / 60) % 60, t % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let wd = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    let mon = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][(month - 1) as usize];
    format!("{wd}, {d:02} {mon} {year} {h:02}:{m:02}:{s:02} GMT")
}

/// A 429 opens the breaker at once (a 503 does not), for the reset hint it carries: delta
/// seconds, HTTP-date, capped at `retry_after_max_ms`, `retry-after-ms`, OpenAI's
/// `x-ratelimit-reset-requests`; without a hint for `rate_limit_ms`. Nothing reaches it before,
/// and a still-limited endpoint gets exactly one probe per window while traffic keeps arriving.
#[test]
fn rate_limit_opens_at_once_for_the_hint_and_recovers_by_single_probes() {
    let a = fast_mock("a", &["m"]);
    let b = fast_mock("b", &["m"]);
    let envoy = Envoy::start(EnvoyConfig::new(
        json!({
            "endpoints": [endpoint("a", 2.0, &["m"]), endpoint("b", 1.0, &["m"])],
            "failure_threshold": 5,
            "open_ms": 60_000,
            "rate_limit_ms": 700,
            "retry_after_max_ms": 3000,
            "half_open_probes": 1,
            "cold_start_samples": 1_000_000,
            "max_attempts": 2,
            "tuning": {"retry_budget_min_retries": 1000},
        }),
        &[("a", a.port), ("b", b.port)],
    ));

    // One 503 is one failure of five: a stays closed and serves the next request.
    a.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    assert_served(&chat(&envoy, "m"), 200, "b", 2);
    assert_eq!(breaker_state(&envoy, "a"), 0.0);
    assert_served(&chat(&envoy, "m"), 200, "a", 1);

    // One 429 opens it, for as long as its hint says (±: 50 ms polling, request latency).
    let c = measure_rate_limit_cooldown(&envoy, &a, mock_status(429));
    assert_between("no hint → rate_limit_ms", c, 700, 1100);
    let c = measure_rate_limit_cooldown(
        &envoy,
        &a,
        json!({"mode": "status", "status": 429, "retry_after": "2"}),
    );
    assert_between("Retry-After: 2", c, 2000, 2400);
    let c = measure_rate_limit_cooldown(
        &envoy,
        &a,
        json!({"mode": "status", "status": 429, "retry_after": http_date_in(3)}),
    );
    // Whole seconds: the date is 2–3 s ahead of the moment the 429 is classified.
    assert_between("Retry-After: <HTTP-date +3 s>", c, 2000, 3400);
    let c = measure_rate_limit_cooldown(
        &envoy,
        &a,
        json!({"mode": "status", "status": 429, "retry_after": "3600"}),
    );
    assert_between("Retry-After: 3600 capped", c, 3000, 3400);
    let c = measure_rate_limit_cooldown(
        &envoy,
        &a,
        json!({"mode": "status", "status": 429, "headers": {"retry-after-ms": "1300"}}),
    );
    assert_between("retry-after-ms: 1300", c, 1300, 1700);
    let c = measure_rate_limit_cooldown(
        &envoy,
        &a,
        json!({"mode": "status", "status": 429,
               "headers": {"x-ratelimit-reset-requests": "1s600ms"}}),
    );
    assert_between("x-ratelimit-reset-requests: 1s600ms", c, 1600, 2000);
    assert_eq!(outcomes(&envoy, "a", "rate_limited"), 6.0);

    // Still limited: traffic keeps arriving for 2.6 s after a 1 s window. Recovery goes through
    // one probe per window (each 429 re-opens it), never a burst.
    a.set_fault(json!({"mode": "status", "status": 429, "retry_after": "1"}));
    let before = a.request_count();
    assert_served(&chat(&envoy, "m"), 200, "b", 2);
    let limited_at = Instant::now();
    sleep_until(limited_at + Duration::from_millis(1200));
    let rs = burst(
        &envoy,
        "m",
        6,
        Duration::from_millis(25),
        limited_at + Duration::from_millis(3800),
    );
    assert!(rs.len() >= 100, "only {} requests", rs.len());
    let failed_over = rs
        .iter()
        .filter(|r| r.header(H_ATTEMPTS) == Some("2"))
        .count();
    // Windows end at ~1.0, ~2.0, ~3.0 s after the first 429: three probes in [1.2, 3.8] s.
    assert_eq!(
        a.request_count() - before,
        4,
        "the first 429 plus one probe per window; {} requests arrived",
        rs.len()
    );
    assert_eq!(failed_over, 3, "each probe got a 429 and was rescued by b");
    for r in &rs {
        assert_eq!(r.status, 200);
        assert_eq!(r.header(H_ENDPOINT), Some("b"));
    }
}

// ---------------------------------------------------------------------------------------------
// 3. 401/403 are per request
// ---------------------------------------------------------------------------------------------

/// A dead key (401/403) is skipped for the rest of that request only: it does not count toward
/// the breaker, and later requests may try it again. Its success rate falls with each dead-key
/// answer (half the way each time: a dead key is no flaky sample), and with it its
/// placement weight (`weight × health level`): once below one half, sessions whose home it was
/// at full weight are placed on the healthy endpoint instead, while sessions it still wins go
/// to it and are served.
///
/// Placement is weighted rendezvous hashing: which sessions move when a weight drops is a pure
/// function of the session and the weights, so each request below is a conversation chosen for
/// the order the filter must give it under the weights it should have computed.
#[test]
fn dead_keys_are_skipped_per_request_and_lower_the_score() {
    let a = fast_mock("a", &["m"]);
    let b = fast_mock("b", &["m"]);
    let envoy = Envoy::start(EnvoyConfig::new(
        json!({
            // Placement weight = weight × health level once warm; health = success rate here
            // (latency factors are 1: a never succeeded, b is the fastest), rounded up to a
            // power of two.
            // Each endpoint sends its own key: a 401/403 is that key's, not the client's.
            "endpoints": [keyed(endpoint("a", 3.0, &["m"])), keyed(endpoint("b", 1.0, &["m"]))],
            "cold_start_samples": 1,
            // Two consecutive endpoint failures would open a breaker; dead keys must not.
            "failure_threshold": 2,
            "max_attempts": 3,
            "tuning": {"retry_budget_min_retries": 1000},
        }),
        &[("a", a.port), ("b", b.port)],
    ));
    // A conversation that comes to a first at full weight (3 against 1), and to `wanted` first
    // under each of `weights` (a's, b's): each step accepts the neighbouring levels a success
    // rate near a boundary can read as, and chooses a conversation they agree on.
    let first = |weights: &'static [(f64, f64)], wanted: &'static [&'static str]| {
        fresh_body_where("m", Value::Null, move |s| {
            placement::starts_with(s, &[("a", 3.0), ("b", 1.0)], &["a", "b"])
                && weights
                    .iter()
                    .all(|&(wa, wb)| placement::starts_with(s, &[("a", wa), ("b", wb)], wanted))
        })
    };
    let send = |body: &str| post_chat(envoy.port, &[], body);

    // Request 1: a (cold, weight 3) answers 401 → b serves. A dead-key answer moves the success
    // rate half the way (a dead key is deterministic, not a flaky sample): 0.5.
    a.set_fault(json!({"mode": "status", "status": 401, "count": 1}));
    assert_served(&send(&first(&[(3.0, 1.0)], &["a"])), 200, "b", 2);
    // Request 2 tries a again (success 0.5: level 1 or 0.5, weight 3 or 1.5, against b's 1):
    // 403 → b serves. Success 0.25.
    a.set_fault(json!({"mode": "status", "status": 403, "count": 1}));
    assert_served(
        &send(&first(&[(3.0, 1.0), (1.5, 1.0)], &["a"])),
        200,
        "b",
        2,
    );
    assert_eq!((a.request_count(), b.request_count()), (2, 2));
    assert_eq!(outcomes(&envoy, "a", "dead_key"), 2.0);
    assert_eq!(
        breaker_state(&envoy, "a"),
        0.0,
        "dead keys must not open the breaker"
    );

    // a's success rate is now 0.25 (a little more as it fades toward neutral): weight 3 × 0.5
    // or 3 × 0.25 against b's 1. Conversations that were a's at full weight but are b's at 1.5 or
    // 0.75 get no first attempt on a, although its key works again.
    for _ in 0..5 {
        assert_served(
            &send(&first(&[(1.5, 1.0), (0.75, 1.0)], &["b"])),
            200,
            "b",
            1,
        );
    }
    assert_eq!(a.request_count(), 2);

    // A conversation a still wins at its lowered weight is tried on a, and this time it works.
    assert_served(
        &send(&first(&[(1.5, 1.0), (0.75, 1.0)], &["a"])),
        200,
        "a",
        1,
    );
    assert_eq!((a.request_count(), b.request_count()), (3, 7));
    assert_eq!(breaker_state(&envoy, "a"), 0.0);
}

// ---------------------------------------------------------------------------------------------
// 4. Failover details
// ---------------------------------------------------------------------------------------------

/// Connect refused, reset and timeout fail over like 5xx, on the first attempt (Envoy's router)
/// and on failover calls; an attempt sequence never repeats an endpoint; `max_attempts` bounds
/// it; the client gets the final upstream's status, headers and body; `x-computeflux-attempts`
/// counts; a client that disconnects (while the first attempt hangs, or mid-failover) leaks no
/// in-flight count; a streamed request fails over before its first byte and is passed through
/// after it (see the module docs).
#[test]
fn failover_kinds_bounds_final_response_disconnects_and_streaming() {
    // Long enough that the in-flight gauge (refreshed on the one-second tick) shows a hanging
    // attempt before it times out, on a loaded machine too: with 2 s a delayed tick missed it.
    const TIMEOUT_MS: u64 = 3000;
    // a streams slowly when asked (`slow`): 16 tokens over 20 ms × factor.
    let a = MockUpstream::start(
        "a",
        &["m", "m2"],
        &["--prefill-us-per-token", "0", "--decode-ms", "20"],
    );
    let b = fast_mock("b", &["m", "m2"]);
    let c = fast_mock("c", &["m"]);
    let d = fast_mock("d", &["m"]);
    let mut cfg = EnvoyConfig::new(
        json!({
            "endpoints": [endpoint("a", 4.0, &["m", "m2"]), endpoint("b", 3.0, &["m", "m2"]),
                          endpoint("c", 2.0, &["m"]), endpoint("d", 1.0, &["m"])],
            "cold_start_samples": 1_000_000,
            "failure_threshold": 1000,
            "max_attempts": 3,
            "failover_timeout_ms": TIMEOUT_MS,
            "tuning": {"retry_budget_min_retries": 1000},
        }),
        &[("a", a.port), ("b", b.port), ("c", c.port), ("d", d.port)],
    );
    cfg.route_timeout_ms = TIMEOUT_MS;
    let envoy = Envoy::start(cfg);
    let counts = || {
        [&a, &b, &c, &d]
            .iter()
            .map(|m| m.request_count())
            .collect::<Vec<_>>()
    };

    // First attempt (through Envoy's router) refused / reset / timed out → b.
    for (fault, label) in [
        (json!({"mode": "refuse"}), "refused"),
        (json!({"mode": "reset"}), "reset"),
        (json!({"mode": "hang"}), "timeout"),
    ] {
        a.set_fault(fault);
        let before = outcomes(&envoy, "a", "endpoint_failure");
        let t = Instant::now();
        let r = chat(&envoy, "m");
        assert_served(&r, 200, "b", 2);
        assert_eq!(r.header("x-mock-endpoint"), Some("b"), "{label}");
        assert_eq!(
            r.json()["object"],
            "chat.completion",
            "{label}: {:?} {}",
            r.headers,
            r.body
        );
        if label == "timeout" {
            // Envoy arms its timer with its cached loop time, so it may fire a few ms "early".
            assert!(
                t.elapsed() >= Duration::from_millis(TIMEOUT_MS - 50),
                "{label}: {:?} {:?}",
                t.elapsed(),
                r.headers
            );
        }
        assert_eq!(
            outcomes(&envoy, "a", "endpoint_failure"),
            before + 1.0,
            "{label}"
        );
    }
    a.clear_fault();
    assert_eq!(counts(), vec![2, 3, 0, 0], "refused connects never reach a");

    // On a failover call (a 503 → b fails → c).
    a.set_fault(mock_status(503));
    for (fault, label) in [
        (json!({"mode": "refuse"}), "refused"),
        (json!({"mode": "reset"}), "reset"),
        (json!({"mode": "hang"}), "timeout"),
    ] {
        b.set_fault(fault);
        let before = outcomes(&envoy, "b", "endpoint_failure");
        let t = Instant::now();
        let r = chat(&envoy, "m");
        assert_served(&r, 200, "c", 3);
        assert_eq!(r.header("x-mock-endpoint"), Some("c"), "{label}");
        if label == "timeout" {
            // Envoy arms its timer with its cached loop time, so it may fire a few ms "early".
            assert!(
                t.elapsed() >= Duration::from_millis(TIMEOUT_MS - 50),
                "{label}: {:?} {:?}",
                t.elapsed(),
                r.headers
            );
        }
        assert_eq!(
            outcomes(&envoy, "b", "endpoint_failure"),
            before + 1.0,
            "{label}"
        );
    }
    b.clear_fault();
    assert_eq!(counts(), vec![5, 5, 3, 0]);

    // max_attempts (3) bounds the sequence; the client gets the third endpoint's response.
    b.set_fault(mock_status(502));
    c.set_fault(json!({"mode": "status", "status": 500,
                       "headers": {"x-which": "c"}, "body": "{\"error\":{\"message\":\"c broke\"}}"}));
    let r = chat(&envoy, "m");
    assert_served(&r, 500, "c", 3);
    assert_eq!(r.header("x-which"), Some("c"));
    assert_eq!(r.header("x-mock-endpoint"), Some("c"));
    assert_eq!(r.body, "{\"error\":{\"message\":\"c broke\"}}");
    assert_eq!(counts(), vec![6, 6, 4, 0], "d is beyond max_attempts");
    // Model m2 has two endpoints: both fail, neither is tried twice (max_attempts would allow 3).
    let r = chat(&envoy, "m2");
    assert_served(&r, 502, "b", 2);
    assert_eq!(r.header("x-mock-endpoint"), Some("b"));
    assert_eq!(r.json()["error"]["message"], "mock b injected status 502");
    assert_eq!(counts(), vec![7, 7, 4, 0]);
    for m in [&a, &b, &c] {
        m.clear_fault();
    }
    assert_eq!(
        metric(&envoy, "computeflux_failovers_total", &[]),
        12.0,
        "one failover per extra attempt"
    );

    // Client disconnects while its first attempt hangs: in-flight goes 1 → 0, cancelled +1.
    let in_flight = |ep: &str| metric(&envoy, "computeflux_in_flight", &[("endpoint", ep)]);
    a.set_fault(json!({"mode": "hang"}));
    let s = raw_request(envoy.port, &fresh_body("m", Value::Null));
    assert!(
        eventually(Duration::from_millis(TIMEOUT_MS - 300), || in_flight("a")
            == 1.0),
        "the hanging attempt never showed in the in-flight gauge"
    );
    drop(s);
    assert!(
        eventually(Duration::from_secs(3), || in_flight("a") == 0.0),
        "in-flight leaked after a client disconnect"
    );
    assert_eq!(outcomes(&envoy, "a", "cancelled"), 1.0);

    // Client disconnects mid-failover (a 503 → b hangs).
    a.set_fault(mock_status(503));
    b.set_fault(json!({"mode": "hang"}));
    let s = raw_request(envoy.port, &fresh_body("m", Value::Null));
    assert!(
        eventually(Duration::from_millis(TIMEOUT_MS - 300), || in_flight("b")
            == 1.0),
        "the hanging failover call never showed in the in-flight gauge"
    );
    drop(s);
    assert!(
        eventually(Duration::from_secs(3), || {
            let p = Prom::of(&envoy);
            p.sum("computeflux_in_flight", &[]) == 0.0
                && p.sum(
                    "computeflux_requests_total",
                    &[("endpoint", "b"), ("outcome", "cancelled")],
                ) == 1.0
        }),
        "in-flight leaked after a disconnect during failover"
    );
    b.clear_fault();
    let before = counts();

    // stream: true, failure before the first byte → failover, delivered buffered but whole.
    let r = post_chat(envoy.port, &[], &fresh_body("m", json!({"stream": true})));
    assert_served(&r, 200, "b", 2);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
    a.clear_fault();

    // stream: true, failure after bytes were sent → passed through (stream cut, no failover).
    a.set_fault(json!({"mode": "slow", "factor": 100})); // ~125 ms per token
    let mut s = raw_request(envoy.port, &fresh_body("m", json!({"stream": true})));
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // The role event and the first token: bytes are on their way to the client.
    while String::from_utf8_lossy(&got).matches("data:").count() < 2 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => panic!(
                "stream ended before its first token: {}",
                String::from_utf8_lossy(&got)
            ),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    a.set_fault(json!({"mode": "refuse"})); // drops a's open connections mid-stream
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("x-computeflux-endpoint: a\r\n"), "{text}");
    assert!(text.contains("x-computeflux-attempts: 1\r\n"), "{text}");
    assert!(!text.contains("[done]"), "the stream was not cut: {text}");
    assert!(
        !text.ends_with("\r\n0\r\n\r\n"),
        "a cut stream must not end cleanly"
    );
    a.clear_fault();
    let after = counts();
    assert_eq!(
        (
            after[1] - before[1],
            after[2] - before[2],
            after[3] - before[3]
        ),
        (1, 0, 0),
        "only the first (pre-byte) streamed failure may fail over"
    );
    assert!(eventually(Duration::from_secs(3), || Prom::of(&envoy)
        .sum("computeflux_in_flight", &[])
        == 0.0));
}

// ---------------------------------------------------------------------------------------------
// 5. Retry budget
// ---------------------------------------------------------------------------------------------

/// During an outage of the preferred endpoint, failovers are limited to
/// `retry_budget_min_retries + retry_budget_percent` % of recent requests; the rest get the
/// failing response as is, and `computeflux_retry_budget_exhausted_total` counts them.
#[test]
fn retry_budget_passes_failures_through_when_spent() {
    const N: usize = 50;
    const MIN: f64 = 2.0;
    const PERCENT: f64 = 20.0;
    let a = fast_mock("a", &["m"]);
    let b = fast_mock("b", &["m"]);
    let envoy = Envoy::start(EnvoyConfig::new(
        json!({
            "endpoints": [endpoint("a", 2.0, &["m"]), endpoint("b", 1.0, &["m"])],
            "cold_start_samples": 1_000_000,
            // The breaker never opens here: every request's first attempt goes to a.
            "failure_threshold": 1000,
            "retry_budget_percent": PERCENT,
            "tuning": {"retry_budget_min_retries": MIN},
        }),
        &[("a", a.port), ("b", b.port)],
    ));
    a.set_fault(mock_status(503));
    let start = Instant::now();
    // Two clients in parallel, so both workers spend the one shared budget.
    let rs: Vec<Response> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| (0..N / 2).map(|_| chat(&envoy, "m")).collect::<Vec<_>>()))
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let elapsed_ms = start.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(rs.len(), N);

    let rescued: Vec<&Response> = rs.iter().filter(|r| r.status == 200).collect();
    let passed: Vec<&Response> = rs.iter().filter(|r| r.status != 200).collect();
    for r in &rescued {
        assert_served(r, 200, "b", 2);
    }
    for r in &passed {
        // The failing response, as a sent it.
        assert_served(r, 503, "a", 1);
        assert_eq!(r.header("x-mock-endpoint"), Some("a"));
        assert_eq!(r.json()["error"]["message"], "mock a injected status 503");
    }
    let retries = rescued.len() as f64;
    // Budget: retries + 1 <= MIN + PERCENT% × requests, both counters decaying with a 10 s time
    // constant; over `elapsed` the decay factor is at least k.
    let k = (-elapsed_ms / 10_000.0).exp();
    let hi = (MIN / k + PERCENT / 100.0 * N as f64).ceil();
    let lo = (MIN + PERCENT / 100.0 * N as f64 * k).floor() - 1.0;
    assert!(
        (lo..=hi).contains(&retries),
        "{retries} failovers for {N} failing requests in {elapsed_ms:.0} ms; budget allows {lo}..={hi}"
    );
    assert_eq!(b.request_count() as f64, retries, "survivor load = budget");
    assert_eq!(a.request_count(), N as u64);
    let p = Prom::of(&envoy);
    assert_eq!(
        p.sum("computeflux_failovers_total", &[("endpoint", "a")]),
        retries
    );
    assert_eq!(
        p.sum("computeflux_retry_budget_exhausted_total", &[]),
        passed.len() as f64
    );
}

// ---------------------------------------------------------------------------------------------
// 6. No endpoint left
// ---------------------------------------------------------------------------------------------

/// When every endpoint for the model is cooling down the filter answers at once, without
/// touching an upstream: 429 if all are rate limited, else 503; `Retry-After` = the earliest
/// recovery; the OpenAI error shape. At that time the endpoint is indeed available again.
#[test]
fn no_endpoint_left_answers_at_once_with_earliest_retry_after() {
    let a = fast_mock("a", &["m1"]);
    let b = fast_mock("b", &["m1"]);
    let c = fast_mock("c", &["m2"]);
    let d = fast_mock("d", &["m2"]);
    let envoy = Envoy::start(EnvoyConfig::new(
        json!({
            "endpoints": [endpoint("a", 2.0, &["m1"]), endpoint("b", 1.0, &["m1"]),
                          endpoint("c", 2.0, &["m2"]), endpoint("d", 1.0, &["m2"])],
            "cold_start_samples": 1_000_000,
            "failure_threshold": 1,
            "open_ms": 2000,
            "rate_limit_ms": 30_000,
            "half_open_probes": 1,
            "max_attempts": 3,
            "tuning": {"retry_budget_min_retries": 1000},
        }),
        &[("a", a.port), ("b", b.port), ("c", c.port), ("d", d.port)],
    ));
    let counts = || {
        [&a, &b, &c, &d]
            .iter()
            .map(|m| m.request_count())
            .collect::<Vec<_>>()
    };

    // m1: both rate limited (a for 4 s, b for 2 s). The request that found out gets b's 429.
    a.set_fault(json!({"mode": "status", "status": 429, "retry_after": "4"}));
    b.set_fault(json!({"mode": "status", "status": 429, "retry_after": "2"}));
    let r = chat(&envoy, "m1");
    assert_served(&r, 429, "b", 2);
    assert_eq!(r.header("x-mock-endpoint"), Some("b"));
    let r = chat(&envoy, "m1");
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(
        r.header("retry-after"),
        Some("2"),
        "earliest recovery is b's"
    );
    assert_eq!(r.header("x-mock-endpoint"), None, "answered by the filter");
    let e = r.json();
    assert_eq!(e["error"]["type"], "rate_limit_error");
    assert_eq!(e["error"]["code"], "rate_limited");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    assert!(r.elapsed < Duration::from_millis(500), "{:?}", r.elapsed);
    assert_eq!(counts(), vec![1, 1, 0, 0]);

    // m2: c rate limited for 5 s, d open after one 503 for open_ms (2 s) → 503, Retry-After 2.
    c.set_fault(json!({"mode": "status", "status": 429, "retry_after": "5"}));
    d.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = chat(&envoy, "m2");
    assert_served(&r, 503, "d", 2);
    assert_eq!(r.header("x-mock-endpoint"), Some("d"));
    let r = chat(&envoy, "m2");
    let rejected_at = Instant::now();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(
        r.header("retry-after"),
        Some("2"),
        "earliest recovery is d's"
    );
    assert_eq!(r.header("x-mock-endpoint"), None);
    let e = r.json();
    assert_eq!(e["error"]["type"], "server_error");
    assert_eq!(e["error"]["code"], "no_endpoint_available");
    assert_eq!(counts(), vec![1, 1, 1, 1]);
    let p = Prom::of(&envoy);
    assert_eq!(
        p.sum("computeflux_rejected_total", &[("reason", "rate_limited")]),
        1.0
    );
    assert_eq!(
        p.sum(
            "computeflux_rejected_total",
            &[("reason", "no_endpoint_available")]
        ),
        1.0
    );

    // Honouring Retry-After works: d (healthy again) is probed and serves.
    sleep_until(rejected_at + Duration::from_millis(2050));
    assert_served(&chat(&envoy, "m2"), 200, "d", 1);
    assert_eq!(counts(), vec![1, 1, 1, 2]);
}
