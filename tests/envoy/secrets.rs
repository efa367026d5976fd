//! No secret leaks, and tenant-scoped affinity, through a real Envoy.
//!
//! Endpoint `headers` values (provider API keys) and client credentials must never appear in
//! Envoy's log (with the filter logging at trace level: `--component-log-level wasm:trace`), in
//! `/stats` or `/stats/prometheus`, or in any response header or error body, on the routed path,
//! on failover (503 and 401), and in the configuration summary. The upstream does receive its
//! own endpoint's key, in place of the client's credential.
//!
//! Tenants: affinity keys hash the client's credential with the session id, so tenant B sending
//! tenant A's session id neither reads A's pin nor moves it.
//!
//! Envoy's *own* `http`/`router` debug logs print whole header maps, the filter-set key
//! included; that is Envoy's behaviour, not the filter's, and why this test raises only the
//! `wasm` component (see docs/hardening.md).

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::http::Response;
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream};

const KEY_A: &str = "Bearer sk-secret-XYZ-aaaa";
const XKEY_A: &str = "sk-secret-XYZ-xkey";
const KEY_B: &str = "Bearer sk-secret-XYZ-bbbb";
/// Distinctive parts that must never show up anywhere but in the upstream's request.
const SECRETS: &[&str] = &[
    "sk-secret-XYZ",
    "client-cred-ABC",
    "tenant-A-cred",
    "tenant-B-cred",
];

struct Fixture {
    a: MockUpstream,
    b: MockUpstream,
    envoy: Envoy,
}

/// `a` (weight 100: every cold pick) and `b` (weight 1), each with its own key.
fn start() -> Fixture {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "0"];
    let a = MockUpstream::start("a", &[], &fast);
    let b = MockUpstream::start("b", &[], &fast);
    let plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "a", "weight": 100,
             "headers": {"authorization": KEY_A, "x-api-key": XKEY_A}},
            {"name": "b", "cluster": "b", "weight": 1,
             "headers": {"Authorization": KEY_B}},
        ],
    });
    let mut cfg = EnvoyConfig::new(plugin, &[("a", a.port), ("b", b.port)]);
    cfg.component_log_level = Some("wasm:trace".into());
    let envoy = Envoy::start(cfg);
    Fixture { a, b, envoy }
}

fn assert_clean(what: &str, text: &str) {
    for s in SECRETS {
        assert!(!text.contains(s), "{what} contains {s:?}:\n{text}");
    }
}

fn assert_clean_response(what: &str, r: &Response) {
    for (k, v) in &r.headers {
        assert_clean(&format!("{what}: response header {k}"), v);
    }
    assert_clean(&format!("{what}: response body"), &r.body);
}

fn chat(f: &Fixture, headers: &[(&str, &str)], text: &str) -> Response {
    let r = post_chat(f.envoy.port, headers, &chat_body("m", &[text], json!({})));
    assert_clean_response(text, &r);
    r
}

fn last_headers(m: &MockUpstream) -> Value {
    m.requests()
        .last()
        .map(|r| r["headers"].clone())
        .unwrap_or_default()
}

#[test]
fn keys_and_credentials_never_leak() {
    let f = start();
    let client = [
        ("authorization", "Bearer client-cred-ABC"),
        ("x-session-id", "leak-test"),
    ];

    // Routed path: `a` gets its own key in place of the client's credential.
    let r = chat(&f, &client, "hello");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("a"));
    let h = last_headers(&f.a);
    assert_eq!(h["authorization"], KEY_A, "{h}");
    assert_eq!(h["x-api-key"], XKEY_A, "{h}");

    // Failover on 503: `b` (a dispatched call) gets b's key, not a's nor the client's.
    f.a.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = chat(&f, &client, "fail over on 503");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-endpoint"), Some("b"));
    let h = last_headers(&f.b);
    assert_eq!(h["authorization"], KEY_B, "{h}");
    assert!(h.get("x-api-key").is_none(), "a's x-api-key went to b: {h}");

    // A dead key (401) on `a`, then on `b` too: the client gets the final 401, no key in it.
    f.a.set_fault(json!({"mode": "status", "status": 401, "count": 1}));
    let r = chat(
        &f,
        &[("authorization", "Bearer client-cred-ABC")],
        "401 once",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    f.a.set_fault(json!({"mode": "status", "status": 401}));
    f.b.set_fault(json!({"mode": "status", "status": 401}));
    let r = chat(
        &f,
        &[("authorization", "Bearer client-cred-ABC")],
        "401 everywhere",
    );
    assert_eq!(r.status, 401, "{}", r.body);
    f.a.clear_fault();
    f.b.clear_fault();

    // Requests the filter refuses or routes without a body.
    let r = post_chat(f.envoy.port, &client, "{nope");
    assert_eq!(r.status, 400);
    assert_clean_response("400", &r);
    let r = support::http::request(
        f.envoy.port,
        "GET",
        "/v1/models",
        &client,
        None,
        support::http::DEFAULT_TIMEOUT,
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_clean_response("GET /v1/models", &r);
    // Not inference: routed without a body or session (the mock's own 404 comes back).
    let r = support::http::request(
        f.envoy.port,
        "GET",
        "/v1/files/x",
        &client,
        None,
        support::http::DEFAULT_TIMEOUT,
    )
    .unwrap();
    assert_eq!(r.status, 404);
    assert_clean_response("GET /v1/files/x", &r);

    // Every upstream request carried an endpoint key, never the client's credential.
    for m in [&f.a, &f.b] {
        for req in m.requests() {
            let auth = req["headers"]["authorization"].as_str().unwrap_or("");
            assert!(auth == KEY_A || auth == KEY_B, "{}: {req}", m.name);
        }
    }

    // Metrics: neither format shows a key or a credential.
    let prom = f.envoy.prometheus();
    assert!(prom.contains("computeflux_requests_total"), "{prom}");
    assert_clean("/stats/prometheus", &prom);
    assert_clean("/stats", &f.envoy.admin_get("/stats").body);

    // The log: the filter's debug lines were emitted (so the check is not vacuous), the summary
    // names the headers but not their values, and no secret appears anywhere.
    // The log file is flushed in batches: wait for each line the checks below rely on.
    for line in [
        "computeflux: attempt 2 -> endpoint b",
        "computeflux: local reply 400 invalid_json",
        "reason=home affinity=none",
    ] {
        assert!(
            f.envoy.wait_for_log(line, Duration::from_secs(3)),
            "no filter debug line {line:?}: {}",
            f.envoy.log_contents()
        );
    }
    let log = f.envoy.log_contents();
    assert!(
        log.contains("headers=[authorization,x-api-key]"),
        "summary without header names:\n{log}"
    );
    assert_clean("Envoy's log", &log);
}

#[test]
fn tenants_cannot_read_or_move_each_others_pins() {
    let f = start();
    let a_cred = [
        ("authorization", "Bearer tenant-A-cred"),
        ("x-session-id", "s1"),
    ];
    let b_cred = [
        ("authorization", "Bearer tenant-B-cred"),
        ("x-session-id", "s1"),
    ];
    let affinity = |r: &Response| r.header("x-computeflux-affinity").unwrap_or("").to_string();
    let endpoint = |r: &Response| r.header("x-computeflux-endpoint").unwrap_or("").to_string();

    // Tenant A pins s1 to `a`.
    let r = chat(&f, &a_cred, "A first");
    assert_eq!((affinity(&r), endpoint(&r)), ("home".into(), "a".into()));
    let r = chat(&f, &a_cred, "A second");
    assert_eq!((affinity(&r), endpoint(&r)), ("hit".into(), "a".into()));

    // Tenant B, same session id: no pin to read. Its first attempt fails on `a` and is served by
    // `b`, which pins B's s1 to `b`. Were keys not tenant-scoped, B would see "hit" here and
    // move A's session to `b`.
    f.a.set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = chat(&f, &b_cred, "B first");
    assert_eq!(affinity(&r), "home", "tenant B read tenant A's pin");
    assert_eq!(endpoint(&r), "b");
    let r = chat(&f, &b_cred, "B second");
    assert_eq!((affinity(&r), endpoint(&r)), ("hit".into(), "b".into()));

    // A's pin is where A put it.
    let r = chat(&f, &a_cred, "A third");
    assert_eq!(
        (affinity(&r), endpoint(&r)),
        ("hit".into(), "a".into()),
        "tenant B moved tenant A's pin"
    );

    // The same id under an x-api-key identity, and with no credential at all: new sessions too.
    let r = chat(
        &f,
        &[("x-api-key", "client-cred-ABC"), ("x-session-id", "s1")],
        "C",
    );
    assert_eq!(affinity(&r), "home");
    let r = chat(&f, &[("x-session-id", "s1")], "anonymous");
    assert_eq!(affinity(&r), "home");
    let r = chat(&f, &[("x-session-id", "s1")], "anonymous again");
    assert_eq!(affinity(&r), "hit");

    assert_clean("Envoy's log", &f.envoy.log_contents());
}
