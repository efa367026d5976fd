//! The filter through a real Envoy (1.40, `--concurrency 2`) in front of real mock upstreams on
//! loopback: routing by body, affinity (header, `user`, fingerprint, TTL), model matching,
//! client errors, endpoint headers, cold start and latency scoring, in-request failover,
//! the all-down answer, metrics and configuration refusal.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream, Response};

fn endpoint(r: &Response) -> String {
    r.header("x-mock-endpoint").unwrap_or("<none>").to_string()
}

fn assert_openai_error(r: &Response, status: u16, code: &str) {
    assert_eq!(r.status, status, "body: {}", r.body);
    let v: Value =
        serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.body));
    assert_eq!(v["error"]["code"], code, "{}", r.body);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{}",
        r.body
    );
    assert!(v["error"]["type"].is_string(), "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"));
}

fn no_panic(envoy: &Envoy) {
    let log = envoy.log_contents();
    assert!(!log.contains("panic"), "wasm panic in the Envoy log");
    assert!(
        !log.contains("Wasm VM failed"),
        "VM failure in the Envoy log"
    );
}

/// Three endpoints: a and b serve m1 and m2, c serves only m1. a carries an API-key header.
fn three(extra: Value) -> (Vec<MockUpstream>, Envoy) {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "1"];
    let mocks = vec![
        MockUpstream::start("a", &[], &fast),
        MockUpstream::start("b", &[], &fast),
        MockUpstream::start("c", &[], &fast),
    ];
    let mut plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "ca", "models": ["m1", "m2"], "headers": {"x-endpoint-key": "Bearer key-a"}},
            {"name": "b", "cluster": "cb", "models": ["m1", "m2"]},
            {"name": "c", "cluster": "cc", "models": ["m1"]}
        ],
        "max_body_bytes": 4096
    });
    if let (Some(p), Value::Object(more)) = (plugin.as_object_mut(), extra) {
        p.extend(more);
    }
    let clusters = [
        ("ca", mocks[0].port),
        ("cb", mocks[1].port),
        ("cc", mocks[2].port),
    ];
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    (mocks, envoy)
}

#[test]
fn sessions_stick_by_header_user_and_fingerprint() {
    let (_mocks, envoy) = three(json!({}));
    // 1. The session header.
    let mut seen = Vec::new();
    for turn in 0..6 {
        let r = post_chat(
            envoy.port,
            &[("x-session-id", "s-1")],
            &chat_body("m1", &["hi"], Value::Null),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-computeflux-affinity"),
            Some(if turn == 0 { "home" } else { "hit" })
        );
        assert_eq!(
            r.header("x-computeflux-endpoint"),
            r.header("x-mock-endpoint")
        );
        seen.push(endpoint(&r));
    }
    assert!(seen.iter().all(|e| *e == seen[0]), "{seen:?}");
    // 2. No header: the body's `user` field.
    let mut seen = Vec::new();
    for turn in 0..4 {
        let body = chat_body(
            "m1",
            &[&format!("question {turn}")],
            json!({"user": "user-7"}),
        );
        let r = post_chat(envoy.port, &[], &body);
        assert_eq!(
            r.header("x-computeflux-affinity"),
            Some(if turn == 0 { "home" } else { "hit" })
        );
        seen.push(endpoint(&r));
    }
    assert!(seen.iter().all(|e| *e == seen[0]), "{seen:?}");
    // 3. Neither: the conversation fingerprint (first system + first user message).
    let turns = [
        "plan a trip to Lisbon",
        "add a day in Porto",
        "and the budget?",
        "thanks",
    ];
    let mut seen = Vec::new();
    for n in 1..=turns.len() {
        let r = post_chat(envoy.port, &[], &chat_body("m1", &turns[..n], Value::Null));
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-computeflux-affinity"),
            Some(if n == 1 { "home" } else { "hit" }),
            "turn {n}"
        );
        seen.push(endpoint(&r));
    }
    assert!(seen.iter().all(|e| *e == seen[0]), "{seen:?}");
    // Many distinct sessions spread over the endpoints (the rendezvous tie-break).
    let mut spread: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..30 {
        let sid = format!("spread-{i}");
        let r = post_chat(
            envoy.port,
            &[("x-session-id", sid.as_str())],
            &chat_body("m1", &["x"], Value::Null),
        );
        *spread.entry(endpoint(&r)).or_default() += 1;
    }
    assert!(
        spread.len() >= 2,
        "new sessions all went to one endpoint: {spread:?}"
    );
    no_panic(&envoy);
}

#[test]
fn models_errors_routing_header_and_endpoint_headers() {
    let (mocks, envoy) = three(json!({}));
    // Model mismatch: c never serves m2.
    for i in 0..12 {
        let sid = format!("m2-{i}");
        let r = post_chat(
            envoy.port,
            &[("x-session-id", sid.as_str())],
            &chat_body("m2", &["q"], Value::Null),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(endpoint(&r), "c");
    }
    let before: u64 = mocks.iter().map(MockUpstream::request_count).sum();
    // Unknown model: 404 model_not_found, no upstream call.
    let r = post_chat(envoy.port, &[], &chat_body("gpt-nope", &["q"], Value::Null));
    assert_openai_error(&r, 404, "model_not_found");
    // Invalid JSON, missing model, non-string model: 400.
    assert_openai_error(
        &post_chat(envoy.port, &[], "{not json"),
        400,
        "invalid_json",
    );
    assert_openai_error(
        &post_chat(envoy.port, &[], r#"{"messages":[]}"#),
        400,
        "missing_model",
    );
    assert_openai_error(
        &post_chat(envoy.port, &[], r#"{"model":42}"#),
        400,
        "invalid_model",
    );
    // Over max_body_bytes (4096 here): 413.
    let big = chat_body("m1", &[&"x".repeat(5000)], Value::Null);
    assert_openai_error(&post_chat(envoy.port, &[], &big), 413, "request_too_large");
    let after: u64 = mocks.iter().map(MockUpstream::request_count).sum();
    assert_eq!(
        before, after,
        "rejected requests must not reach an upstream"
    );

    // A client-sent routing header is ignored: c does not serve m2, so obeying the header
    // would send this to c.
    for i in 0..6 {
        let sid = format!("rh-{i}");
        let r = post_chat(
            envoy.port,
            &[
                ("x-session-id", sid.as_str()),
                ("x-computeflux-cluster", "cc"),
            ],
            &chat_body("m2", &["q"], Value::Null),
        );
        assert_eq!(r.status, 200);
        assert_ne!(endpoint(&r), "c");
    }
    // Endpoint headers reach that endpoint's upstream, and only that one.
    let a_reqs = mocks[0].requests();
    assert!(
        !a_reqs.is_empty(),
        "a served nothing; the test cannot check its header"
    );
    assert!(
        a_reqs
            .iter()
            .all(|q| q["headers"]["x-endpoint-key"] == "Bearer key-a"),
        "{a_reqs:?}"
    );
    for m in &mocks[1..] {
        assert!(m
            .requests()
            .iter()
            .all(|q| q["headers"].get("x-endpoint-key").is_none()));
    }
    // Nobody upstream sees the routing header.
    for m in &mocks {
        assert!(m
            .requests()
            .iter()
            .all(|q| q["headers"].get("x-computeflux-cluster").is_none()));
    }
    // Metrics with the endpoint as a Prometheus label.
    let prom = envoy.prometheus();
    for name in ["a", "b"] {
        let line = format!("computeflux_requests_total{{endpoint=\"{name}\",outcome=\"success\"}}");
        assert!(prom.contains(&line), "missing {line} in\n{prom}");
    }
    assert!(
        prom.contains("computeflux_rejected_total{reason=\"model_not_found\"} 1"),
        "{prom}"
    );
    assert!(
        prom.contains("computeflux_affinity_total{result=\"home\"}"),
        "{prom}"
    );
    assert!(
        prom.contains("computeflux_breaker_state{endpoint=\"c\"} 0"),
        "{prom}"
    );
    no_panic(&envoy);
}

#[test]
fn stickiness_expires_after_the_ttl() {
    let (_mocks, envoy) = three(json!({"affinity_ttl_ms": 1500}));
    let body = chat_body("m1", &["hello"], Value::Null);
    let h = [("x-session-id", "ttl-1")];
    assert_eq!(
        post_chat(envoy.port, &h, &body).header("x-computeflux-affinity"),
        Some("home")
    );
    std::thread::sleep(Duration::from_millis(700));
    // A success refreshes the idle timer...
    assert_eq!(
        post_chat(envoy.port, &h, &body).header("x-computeflux-affinity"),
        Some("hit")
    );
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        post_chat(envoy.port, &h, &body).header("x-computeflux-affinity"),
        Some("hit")
    );
    // ... and after a full TTL of idleness the pin is gone.
    std::thread::sleep(Duration::from_millis(1700));
    assert_eq!(
        post_chat(envoy.port, &h, &body).header("x-computeflux-affinity"),
        Some("home")
    );
}

#[test]
fn cold_endpoint_chosen_by_weight() {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "1"];
    let light = MockUpstream::start("light", &[], &fast);
    let heavy = MockUpstream::start("heavy", &[], &fast);
    let plugin = json!({"endpoints": [
        {"name": "light", "cluster": "cl", "weight": 1},
        {"name": "heavy", "cluster": "ch", "weight": 3}
    ], "cold_start_samples": 1000});
    let envoy = Envoy::start(EnvoyConfig::new(
        plugin,
        &[("cl", light.port), ("ch", heavy.port)],
    ));
    // While cold, placement weighs the weight alone: new sessions split 3:1 (weighted
    // rendezvous; the session ids are fixed, so the split is too).
    let mut heavy_sessions = 0;
    for i in 0..80 {
        let sid = format!("cold-{i}");
        let r = post_chat(
            envoy.port,
            &[("x-session-id", sid.as_str())],
            &chat_body("m", &["q"], Value::Null),
        );
        heavy_sessions += u32::from(endpoint(&r) == "heavy");
    }
    assert!(
        (50..=70).contains(&heavy_sessions),
        "{heavy_sessions} of 80 new sessions on the weight-3 endpoint"
    );
    assert_eq!(light.request_count(), 80 - u64::from(heavy_sessions));
    assert!(envoy
        .prometheus()
        .contains("computeflux_decisions_total{reason=\"home\"} 80"));
}

#[test]
fn slow_endpoint_loses_new_sessions_after_warm_up() {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "1"];
    let quick = MockUpstream::start("quick", &[], &fast);
    let slow = MockUpstream::start("slow", &[], &fast);
    slow.set_fault(json!({"mode": "delay_ms", "ms": 150}));
    let plugin = json!({"endpoints": [
        {"name": "quick", "cluster": "cq"}, {"name": "slow", "cluster": "cs"}
    ], "cold_start_samples": 5, "tuning": {"degraded_probe_interval_ms": 600000}});
    let envoy = Envoy::start(EnvoyConfig::new(
        plugin,
        &[("cq", quick.port), ("cs", slow.port)],
    ));
    // Warm both up: equal weights while cold, so sessions spread by rendezvous hash. The work
    // model judges answers once it has 32 of them; each endpoint then needs 5 judged answers
    // (`cold_start_samples`) before it can be degraded: 60 requests in all.
    let mut i = 0;
    while (quick.request_count() < 5
        || slow.request_count() < 5
        || quick.request_count() + slow.request_count() < 60)
        && i < 300
    {
        let sid = format!("warm-{i}");
        post_chat(
            envoy.port,
            &[("x-session-id", sid.as_str())],
            &chat_body("m", &["q"], Value::Null),
        );
        i += 1;
    }
    assert!(
        slow.request_count() >= 5,
        "slow endpoint never got its warm-up samples"
    );
    let slow_before = slow.request_count();
    for i in 0..20 {
        let sid = format!("after-{i}");
        let r = post_chat(
            envoy.port,
            &[("x-session-id", sid.as_str())],
            &chat_body("m", &["q"], Value::Null),
        );
        assert_eq!(
            endpoint(&r),
            "quick",
            "new session {i} went to the slow endpoint"
        );
    }
    assert_eq!(slow.request_count(), slow_before);
    let prom = envoy.prometheus();
    assert!(
        prom.contains("computeflux_ewma_latency_ms{endpoint=\"slow\"}"),
        "{prom}"
    );
}

#[test]
fn rate_limit_and_dead_key_fail_over_inside_the_request() {
    // Each endpoint sends its own key: a 401 is that key's, not the client's (issue 22).
    let (mocks, envoy) = three(json!({"endpoints": [
        {"name": "a", "cluster": "ca", "models": ["m1", "m2"], "headers": {"authorization": "Bearer key-a"}},
        {"name": "b", "cluster": "cb", "models": ["m1", "m2"], "headers": {"authorization": "Bearer key-b"}},
        {"name": "c", "cluster": "cc", "models": ["m1"], "headers": {"authorization": "Bearer key-c"}}
    ]}));
    let body = chat_body("m1", &["hello"], Value::Null);
    let h = [("x-session-id", "fo-1")];
    let first = post_chat(envoy.port, &h, &body);
    let pinned = endpoint(&first);
    let idx = |name: &str| ["a", "b", "c"].iter().position(|n| *n == name).unwrap();
    // The pinned endpoint starts answering 429 with a long Retry-After.
    mocks[idx(&pinned)].set_fault(json!({"mode": "status", "status": 429, "retry_after": "30"}));
    let r = post_chat(envoy.port, &h, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(endpoint(&r), pinned);
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    assert_eq!(
        r.header("x-computeflux-endpoint"),
        r.header("x-mock-endpoint")
    );
    assert_eq!(mocks[idx(&pinned)].stats()["status_counts"]["429"], 1);
    // The success re-pinned the session; the limited endpoint is not tried again (breaker).
    let second = endpoint(&r);
    let r = post_chat(envoy.port, &h, &body);
    assert_eq!(
        (endpoint(&r).as_str(), r.header("x-computeflux-attempts")),
        (second.as_str(), Some("1"))
    );
    assert_eq!(r.header("x-computeflux-affinity"), Some("hit"));
    // Now the new pin's key is dead (401): the request fails over to the third endpoint.
    mocks[idx(&second)].set_fault(json!({"mode": "status", "status": 401}));
    let r = post_chat(envoy.port, &h, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let third = endpoint(&r);
    assert!(third != pinned && third != second, "{third}");
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    let prom = envoy.prometheus();
    assert!(
        prom.contains(&format!(
            "computeflux_requests_total{{endpoint=\"{pinned}\",outcome=\"rate_limited\"}} 1"
        )),
        "{prom}"
    );
    assert!(
        prom.contains(&format!(
            "computeflux_requests_total{{endpoint=\"{second}\",outcome=\"dead_key\"}} 1"
        )),
        "{prom}"
    );
    no_panic(&envoy);
}

#[test]
fn all_endpoints_down_gives_a_prompt_503() {
    let fast = ["--prefill-us-per-token", "0", "--decode-ms", "1"];
    let a = MockUpstream::start("a", &[], &fast);
    let b = MockUpstream::start("b", &[], &fast);
    let plugin = json!({"endpoints": [{"name": "a", "cluster": "ca"}, {"name": "b", "cluster": "cb"}],
        "failure_threshold": 1, "open_ms": 20000});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("ca", a.port), ("cb", b.port)]));
    a.set_fault(json!({"mode": "status", "status": 503}));
    b.set_fault(json!({"mode": "refuse"}));
    let body = chat_body("m", &["q"], Value::Null);
    // The first request tries both (503, then connect refused) and fails.
    let r = post_chat(envoy.port, &[], &body);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    // Now both breakers are open: answered at once, without touching an upstream.
    let before = a.request_count();
    let t = Instant::now();
    let r = post_chat(envoy.port, &[], &body);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "took {:?}",
        t.elapsed()
    );
    assert_openai_error(&r, 503, "no_endpoint_available");
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((1..=20).contains(&retry), "retry-after {retry}");
    assert_eq!(a.request_count(), before);
    no_panic(&envoy);
}

#[test]
fn envoy_and_callout_failures_answer_in_the_openai_shape() {
    // Both endpoints refuse connections: the first attempt fails in Envoy's router (its local
    // reply), the failover call fails inside the filter's callout. Either way the client gets
    // the OpenAI error shape.
    let a = MockUpstream::start("a", &[], &[]);
    let b = MockUpstream::start("b", &[], &[]);
    a.set_fault(json!({"mode": "refuse"}));
    b.set_fault(json!({"mode": "refuse"}));
    let plugin = json!({"endpoints": [{"name": "a", "cluster": "ca"}, {"name": "b", "cluster": "cb"}], "max_attempts": 2});
    let envoy = Envoy::start(EnvoyConfig::new(
        plugin.clone(),
        &[("ca", a.port), ("cb", b.port)],
    ));
    let r = post_chat(envoy.port, &[], &chat_body("m", &["q"], Value::Null));
    assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
    assert_openai_error(&r, 503, "upstream_unavailable");
    drop(envoy);
    // A single attempt: the router's own reply.
    let mut one = plugin;
    one["max_attempts"] = json!(1);
    let envoy = Envoy::start(EnvoyConfig::new(one, &[("ca", a.port), ("cb", b.port)]));
    let r = post_chat(envoy.port, &[], &chat_body("m", &["q"], Value::Null));
    assert_openai_error(&r, 503, "upstream_unavailable");
}

#[test]
fn streaming_responses_stream_through_on_the_happy_path() {
    let a = MockUpstream::start(
        "a",
        &[],
        &["--prefill-us-per-token", "0", "--decode-ms", "200"],
    );
    let plugin = json!({"endpoints": [{"name": "a", "cluster": "ca"}]});
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("ca", a.port)]));
    let r = post_chat(
        envoy.port,
        &[("x-session-id", "sse")],
        &chat_body("m", &["q"], json!({"stream": true})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
    assert!(r.chunk_times.len() > 2, "not streamed: {:?}", r.chunk_times);
    let first = r.chunk_times.first().copied().unwrap_or_default();
    let last = r.chunk_times.last().copied().unwrap_or_default();
    assert!(
        last - first >= Duration::from_millis(100),
        "chunks arrived together: {:?}",
        r.chunk_times
    );
}

#[test]
fn invalid_configuration_is_refused_naming_the_field() {
    let plugin =
        json!({"endpoints": [{"name": "a", "cluster": "ca", "weight": -1}], "ewma_alpha": 2});
    let err = match Envoy::try_start(EnvoyConfig::new(plugin, &[("ca", 9)])) {
        Ok(_) => panic!("Envoy started with an invalid plugin configuration"),
        Err(log) => log,
    };
    assert!(
        err.contains("endpoints[0].weight must be > 0, got -1"),
        "{err}"
    );
    assert!(err.contains("ewma_alpha must be in (0, 1], got 2"), "{err}");
}

#[test]
fn shipped_envoy_yaml_passes_validate() {
    let root = support::repo_root();
    let wasm = support::wasm_path();
    let yaml = std::fs::read_to_string(root.join("envoy/envoy.yaml")).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "computeflux-validate-local-{}",
        support::unique_u32()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("envoy.yaml");
    std::fs::write(
        &cfg,
        yaml.replace(
            "target/wasm32-wasip1/release/computeflux.wasm",
            &wasm.display().to_string(),
        ),
    )
    .unwrap();
    let out = std::process::Command::new(support::envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("OK"), "{text}");
    assert!(text.contains("configuration accepted"), "{text}");
}
