//! Tests of the test harness itself: the mock upstream behaves as documented (prefix cache,
//! faults, SSE) and a plain Envoy started by `support::Envoy` proxies to it over HTTP/1.1 and h2c.
//! If these fail, the filter's integration tests cannot be trusted.

use crate::support;

use std::io::ErrorKind;
use std::time::Duration;

use serde_json::{json, Value};
use support::http::{self, try_post_chat};
use support::{chat_body, curl_h2, post_chat, Envoy, EnvoyConfig, MockUpstream};

fn count(stats: &Value, key: &str) -> u64 {
    stats
        .pointer(&format!("/status_counts/{key}"))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

#[test]
fn envoy_without_filter_proxies_to_first_cluster() {
    let a = MockUpstream::start(
        "a",
        &["m1"],
        &["--prefill-us-per-token", "0", "--decode-ms", "20"],
    );
    let b = MockUpstream::start("b", &["m1"], &[]);
    let mut cfg = EnvoyConfig::new(json!({}), &[("a", a.port), ("b", b.port)]);
    cfg.with_filter = false;
    let envoy = Envoy::start(cfg);
    assert_ne!(envoy.port, 0);
    assert_ne!(envoy.port, envoy.admin_port);

    let body = chat_body("m1", &["hello there"], json!({"user": "s1"}));
    let r = post_chat(
        envoy.port,
        &[("x-endpoint-probe", "yes"), ("authorization", "Bearer k")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-mock-endpoint"), Some("a"));
    assert_eq!(r.json()["object"], "chat.completion");

    // HTTP/2 (h2c) downstream through the same listener.
    let r2 = curl_h2(envoy.port, "POST", "/v1/chat/completions", &[], Some(&body));
    assert_eq!(r2.status, 200, "{}", r2.body);
    assert_eq!(r2.header("x-mock-endpoint"), Some("a"));

    // A streamed answer is relayed chunk by chunk.
    let sbody = chat_body("m1", &["stream please"], json!({"stream": true}));
    let s = post_chat(envoy.port, &[], &sbody);
    assert_eq!(s.status, 200);
    assert_eq!(s.sse_data().last().map(String::as_str), Some("[DONE]"));
    assert!(
        s.chunk_times.len() > 2,
        "expected several chunks, got {:?}",
        s.chunk_times
    );

    assert_eq!(a.request_count(), 3);
    assert_eq!(b.request_count(), 0);
    let reqs = a.requests();
    assert_eq!(reqs.len(), 3);
    let first = &reqs[0];
    assert_eq!(first["headers"]["x-endpoint-probe"], "yes");
    assert_eq!(first["headers"]["authorization"], "Bearer k");
    assert_eq!(first["model"], "m1");
    assert_eq!(first["status"], 200);
    assert_eq!(first["user"], "s1");

    // Admin helpers work.
    assert!(envoy.stat("cluster.a.upstream_rq_total").unwrap_or(0) >= 3);
    assert!(envoy
        .prometheus()
        .contains("envoy_cluster_upstream_rq_total"));
    assert!(
        envoy.wait_for_log("starting main dispatch loop", Duration::from_secs(2)),
        "{}",
        envoy.log_contents()
    );
}

#[test]
fn mock_prefix_cache_makes_second_turn_cached_and_faster() {
    // 1 ms per uncached token: the first turn (~300 tokens) costs ~300 ms of prefill.
    let m = MockUpstream::start(
        "cache",
        &[],
        &["--prefill-us-per-token", "1000", "--decode-ms", "5"],
    );
    let long = "the quick brown fox jumps over the lazy dog ".repeat(27); // 1188 bytes
    let turn1 = chat_body("m", &[&long], Value::Null);
    let turn2 = chat_body("m", &[&long, "and then?"], Value::Null);

    let r1 = post_chat(m.port, &[], &turn1);
    assert_eq!(r1.status, 200, "{}", r1.body);
    let u1 = r1.json()["usage"].clone();
    assert_eq!(u1["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r1.header("x-mock-cached-tokens"), Some("0"));
    let p1 = u1["prompt_tokens"].as_u64().unwrap_or(0);
    assert_eq!(p1, (("user\n".len() + long.len() + 1) as u64).div_ceil(4));

    let r2 = post_chat(m.port, &[], &turn2);
    assert_eq!(r2.status, 200);
    let u2 = r2.json()["usage"].clone();
    let cached = u2["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let p2 = u2["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(p2 > p1);
    // Every full 16-token block of turn 1 is reused.
    assert_eq!(cached, p1 / 16 * 16, "turn 2 usage: {u2}");
    assert_eq!(
        r2.header("x-mock-cached-tokens"),
        Some(cached.to_string().as_str())
    );
    assert_eq!(
        r2.header("x-mock-prompt-tokens"),
        Some(p2.to_string().as_str())
    );
    assert!(
        r2.elapsed * 2 < r1.elapsed,
        "cached turn took {:?}, uncached {:?}",
        r2.elapsed,
        r1.elapsed
    );

    // Another model does not share the cache; a flushed cache forgets.
    let other = post_chat(
        m.port,
        &[],
        &chat_body("other", &[&long, "and then?"], Value::Null),
    );
    assert_eq!(other.header("x-mock-cached-tokens"), Some("0"));
    m.flush_cache();
    let r3 = post_chat(m.port, &[], &turn2);
    assert_eq!(r3.header("x-mock-cached-tokens"), Some("0"));

    let st = m.stats();
    assert_eq!(st["requests"], 4);
    assert_eq!(st["cached_tokens"], cached);
    assert_eq!(count(&st, "200"), 4);
    assert_eq!(st["in_flight"], 0);
}

#[test]
fn mock_status_fault_with_retry_after_and_count() {
    let m = MockUpstream::start(
        "f",
        &["m1"],
        &["--prefill-us-per-token", "0", "--decode-ms", "0"],
    );
    let body = chat_body("m1", &["hi"], Value::Null);
    m.set_fault(json!({"mode": "status", "status": 429, "retry_after": "2",
                       "headers": {"x-ratelimit-remaining-requests": "0"}, "count": 2}));
    for _ in 0..2 {
        let r = post_chat(m.port, &[], &body);
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("2"));
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
        assert_eq!(r.header("x-mock-endpoint"), Some("f"));
        assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    }
    // count exhausted: back to normal
    assert_eq!(post_chat(m.port, &[], &body).status, 200);
    assert_eq!(m.stats()["fault"]["mode"], "none");

    m.set_fault(json!({"mode": "status", "status": 503}));
    assert_eq!(post_chat(m.port, &[], &body).status, 503);
    assert_eq!(post_chat(m.port, &[], &body).status, 503);
    m.clear_fault();

    // Unknown model: OpenAI-style 404.
    let r = post_chat(m.port, &[], &chat_body("nope", &["hi"], Value::Null));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");

    let st = m.stats();
    assert_eq!(st["requests"], 6);
    assert_eq!(count(&st, "429"), 2);
    assert_eq!(count(&st, "503"), 2);
    assert_eq!(count(&st, "200"), 1);
    assert_eq!(count(&st, "404"), 1);
    let statuses: Vec<Value> = m.requests().iter().map(|r| r["status"].clone()).collect();
    assert_eq!(
        statuses,
        vec![
            json!(429),
            json!(429),
            json!(200),
            json!(503),
            json!(503),
            json!(404)
        ]
    );

    m.reset_stats();
    assert_eq!(m.stats()["requests"], 0);
    assert!(m.requests().is_empty());
    let models = http::get(m.port, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "m1");
}

#[test]
fn mock_refuse_then_recover_on_same_port() {
    let m = MockUpstream::start(
        "r",
        &[],
        &["--prefill-us-per-token", "0", "--decode-ms", "0"],
    );
    let body = chat_body("m", &["hi"], Value::Null);
    let port = m.port;
    assert_eq!(post_chat(port, &[], &body).status, 200);

    m.set_fault(json!({"mode": "refuse"}));
    let err = try_post_chat(port, &[], &body).expect_err("connect must be refused");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert_eq!(m.stats()["listening"], false);

    m.clear_fault();
    assert_eq!(m.port, port);
    let r = post_chat(port, &[], &body);
    assert_eq!(r.status, 200);
    // The refused connect never reached the mock.
    assert_eq!(m.stats()["requests"], 2);

    // refuse with for_ms lifts itself.
    m.set_fault(json!({"mode": "refuse", "for_ms": 300}));
    assert!(try_post_chat(port, &[], &body).is_err());
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(post_chat(port, &[], &body).status, 200);
}

#[test]
fn mock_reset_and_hang() {
    let m = MockUpstream::start(
        "h",
        &[],
        &["--prefill-us-per-token", "0", "--decode-ms", "0"],
    );
    let body = chat_body("m", &["hi"], Value::Null);

    m.set_fault(json!({"mode": "reset", "count": 1}));
    let err = try_post_chat(m.port, &[], &body).expect_err("reset must fail the request");
    assert!(
        matches!(
            err.kind(),
            ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof
        ),
        "{err:?}"
    );

    m.set_fault(json!({"mode": "hang"}));
    let started = std::time::Instant::now();
    let err = http::request(
        m.port,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(body.as_bytes()),
        Duration::from_millis(400),
    )
    .expect_err("hang must time out");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));
    m.clear_fault();
    assert_eq!(post_chat(m.port, &[], &body).status, 200);

    let st = m.stats();
    assert_eq!(count(&st, "reset"), 1);
    assert_eq!(count(&st, "hang"), 1);
    assert_eq!(count(&st, "200"), 1);
    assert_eq!(st["requests"], 3);
}

#[test]
fn mock_slow_and_delay_faults_add_latency() {
    let m = MockUpstream::start(
        "s",
        &[],
        &["--prefill-us-per-token", "0", "--decode-ms", "30"],
    );
    let body = chat_body("m", &["hi"], Value::Null);
    let base = post_chat(m.port, &[], &body).elapsed;
    m.set_fault(json!({"mode": "delay_ms", "ms": 300, "count": 1}));
    let delayed = post_chat(m.port, &[], &body);
    assert_eq!(delayed.status, 200);
    assert!(
        delayed.ttfb >= Duration::from_millis(300),
        "{:?}",
        delayed.ttfb
    );
    m.set_fault(json!({"mode": "slow", "factor": 10}));
    let slow = post_chat(m.port, &[], &body).elapsed;
    assert!(
        slow >= Duration::from_millis(300),
        "slow {slow:?}, base {base:?}"
    );
}

#[test]
fn mock_sse_stream_shape() {
    let m = MockUpstream::start(
        "sse",
        &[],
        &[
            "--prefill-us-per-token",
            "0",
            "--decode-ms",
            "80",
            "--completion-tokens",
            "8",
        ],
    );
    let body = chat_body("m", &["stream"], json!({"stream": true}));
    let r = post_chat(m.port, &[], &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("x-mock-endpoint"), Some("sse"));
    let data = r.sse_data();
    // role chunk + 8 content chunks + finish chunk + usage chunk + [DONE]
    assert_eq!(data.len(), 12, "{data:?}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let events: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or(Value::Null))
        .collect();
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events[1..9]
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(text.starts_with("[sse]"), "{text}");
    assert_eq!(events[9]["choices"][0]["finish_reason"], "stop");
    assert_eq!(events[10]["choices"], json!([]));
    assert_eq!(events[10]["usage"]["completion_tokens"], 8);
    assert!(events[10]["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    // Chunks were flushed over time (80 ms of decode spread over 8 tokens), not all at once.
    let first = r.chunk_times.first().copied().unwrap_or_default();
    let last = r.chunk_times.last().copied().unwrap_or_default();
    assert!(
        last - first >= Duration::from_millis(50),
        "{:?}",
        r.chunk_times
    );
    assert_eq!(m.stats()["in_flight"], 0);

    // max_tokens caps the answer.
    let short = post_chat(
        m.port,
        &[],
        &chat_body("m", &["x"], json!({"max_tokens": 2})),
    );
    assert_eq!(short.json()["usage"]["completion_tokens"], 2);
}

#[test]
fn rendered_bootstrap_passes_envoy_validate() {
    let mut cfg = EnvoyConfig::new(json!({}), &[("a", 18001), ("b", 18002)]);
    cfg.with_filter = false;
    cfg.route_extra = json!({"retry_policy": {"retry_on": "retriable-status-codes",
                                              "retriable_status_codes": [503], "num_retries": 1}});
    let text = support::render_bootstrap(&cfg, std::path::Path::new("/unused.wasm"), 0, 0);
    let dir = std::env::temp_dir().join(format!("computeflux-validate-{}", support::unique_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, &text).unwrap();
    let out = std::process::Command::new(support::envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{stdout}\n{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The filter-less route goes to the first cluster; the routing header is unused.
    assert!(text.contains("\"cluster\": \"a\""), "{text}");
    assert!(!text.contains("envoy.filters.http.wasm"));
    // With the filter, the route reads the cluster from plugin_config.routing_header.
    let cfg = EnvoyConfig::new(json!({"routing_header": "X-Route-To"}), &[("a", 1)]);
    let text = support::render_bootstrap(&cfg, std::path::Path::new("/m.wasm"), 0, 0);
    assert!(
        text.contains("\"cluster_header\": \"x-route-to\""),
        "{text}"
    );
    assert!(text.contains("\"allow_on_headers_stop_iteration\": true"));
    assert!(text.contains("\"failure_policy\": \"FAIL_RELOAD\""));
    let v: Value = serde_json::from_str(&text).unwrap();
    let route = v
        .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0")
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(
        route["request_headers_to_remove"],
        json!(["x-route-to"]),
        "{route}"
    );
    assert_eq!(route["route"]["cluster_header"], "x-route-to");
}
