//! The mock upstream's batched engine model (`--engine batched`, tests/tools/src/mock_upstream/
//! engine.rs), which the routing benchmark runs against, without Envoy.
//!
//! What must hold, because a router judged against this mock is only judged fairly if the mock
//! loads up like an inference server: requests beyond `--max-concurrency` wait in a queue, and
//! `GET /metrics` reports that queue, the running batch and the token counters under the real
//! engines' metric names; a plain answer's headers come after the whole generation, a streamed
//! answer's first bytes after the prefill; `max_tokens` is generated exactly with
//! `--output-tokens max_tokens`; the `slow` fault slows requests already running.

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
use support::{get, post_chat, MockUpstream};

const MS_PER_TOKEN: &str = "4";

fn engine(extra: &[&str]) -> MockUpstream {
    let mut args = vec![
        "--engine",
        "batched",
        "--output-tokens",
        "max_tokens",
        "--decode-ms-per-token",
        MS_PER_TOKEN,
        "--batch-slowdown",
        "0",
    ];
    args.extend_from_slice(extra);
    MockUpstream::start("e", &["m1"], &args)
}

fn body(tag: &str, max_tokens: u64, stream: bool) -> String {
    json!({"model": "m1", "max_tokens": max_tokens, "stream": stream,
           "messages": [{"role": "user", "content": format!("hello {tag}")}]})
    .to_string()
}

/// The value of one series (its name with labels, as written) in a text exposition.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(s, _)| *s == name)
        .and_then(|(_, v)| v.parse().ok())
}

const VLLM: &str = "{engine=\"0\",model_name=\"m1\"}";

#[test]
fn requests_beyond_the_slots_queue_and_metrics_report_the_queue() {
    let m = engine(&["--max-concurrency", "1"]);
    let t0 = Instant::now();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let port = m.port;
            std::thread::spawn(move || {
                let r = post_chat(port, &[], &body(&i.to_string(), 100, false));
                assert_eq!(r.status, 200, "{}", r.body);
                t0.elapsed()
            })
        })
        .collect();
    // One runs, two wait: seen on /metrics while the first is decoding (≈ 400 ms).
    let mut seen = None;
    while t0.elapsed() < Duration::from_millis(1500) {
        let text = get(m.port, "/metrics").body;
        let (w, r) = (
            series(&text, &format!("vllm:num_requests_waiting{VLLM}")),
            series(&text, &format!("vllm:num_requests_running{VLLM}")),
        );
        if (w, r) == (Some(2.0), Some(1.0)) {
            seen = Some(text);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = seen.expect("never saw waiting 2, running 1 on /metrics");
    let kv = series(&text, &format!("vllm:kv_cache_usage_perc{VLLM}")).unwrap();
    assert!(
        kv > 0.0 && kv < 1.0,
        "the running request holds some KV blocks: {kv}"
    );
    let mut done: Vec<Duration> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    done.sort();
    // One slot: the answers come one after the other, each ≈ 100 × 4 ms.
    assert!(done[0] >= Duration::from_millis(380), "{done:?}");
    assert!(
        done[2] >= Duration::from_millis(1150),
        "served one at a time: {done:?}"
    );

    let text = get(m.port, "/metrics").body;
    assert_eq!(
        series(&text, &format!("vllm:num_requests_waiting{VLLM}")),
        Some(0.0)
    );
    assert_eq!(
        series(&text, &format!("vllm:num_requests_running{VLLM}")),
        Some(0.0)
    );
    assert_eq!(
        series(&text, &format!("vllm:kv_cache_usage_perc{VLLM}")),
        Some(0.0)
    );
    let stats = m.stats();
    assert_eq!(
        series(&text, &format!("vllm:prompt_tokens_total{VLLM}")),
        stats["prompt_tokens"].as_f64()
    );
    assert_eq!(
        series(&text, &format!("vllm:generation_tokens_total{VLLM}")),
        Some(300.0)
    );
}

#[test]
fn plain_answers_come_after_the_generation_streams_after_the_prefill() {
    let m = engine(&[]);
    let plain = post_chat(m.port, &[], &body("p", 100, false));
    assert_eq!(plain.status, 200);
    assert!(
        plain.ttfb >= Duration::from_millis(380),
        "plain ttfb {:?}",
        plain.ttfb
    );
    assert_eq!(plain.json()["usage"]["completion_tokens"], 100);

    let streamed = post_chat(m.port, &[], &body("s", 100, true));
    assert_eq!(streamed.status, 200);
    assert!(
        streamed.ttfb < Duration::from_millis(200),
        "stream ttfb {:?}",
        streamed.ttfb
    );
    assert!(
        streamed.elapsed >= Duration::from_millis(380),
        "{:?}",
        streamed.elapsed
    );
    let usage: Vec<Value> = streamed
        .sse_data()
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "one usage chunk: {}", streamed.body);
    assert_eq!(usage[0]["usage"]["completion_tokens"], 100);
}

#[test]
fn the_slow_fault_slows_a_request_already_running() {
    let m = engine(&[]);
    let port = m.port;
    let t0 = Instant::now();
    let w = std::thread::spawn(move || post_chat(port, &[], &body("x", 150, false)));
    std::thread::sleep(Duration::from_millis(100));
    m.set_fault(json!({"mode": "slow", "factor": 5}));
    let r = w.join().unwrap();
    assert_eq!(r.status, 200);
    // 150 × 4 ms = 600 ms unslowed; ≈ 25 tokens before the fault, the rest 5× slower.
    assert!(
        t0.elapsed() >= Duration::from_millis(1800),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn each_metrics_format_uses_the_engines_names() {
    let cases: [(&str, &[&str]); 4] = [
        (
            "vllm",
            &[
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
            ],
        ),
        (
            "sglang",
            &[
                "sglang:num_queue_reqs",
                "sglang:num_running_reqs",
                "sglang:token_usage",
            ],
        ),
        (
            "llamacpp",
            &[
                "llamacpp:requests_deferred",
                "llamacpp:requests_processing",
                "llamacpp:prompt_tokens_total",
                "llamacpp:prompt_tokens_cached_total",
            ],
        ),
        ("tgi", &["tgi_queue_size", "tgi_batch_current_size"]),
    ];
    for (format, names) in cases {
        let m = engine(&["--metrics-format", format]);
        let r = get(m.port, "/metrics");
        assert_eq!(r.status, 200);
        assert!(
            r.header("content-type")
                .unwrap_or("")
                .starts_with("text/plain"),
            "{format}"
        );
        for name in names {
            assert!(
                r.body.contains(&format!("# TYPE {name} ")),
                "{format}: no TYPE line for {name}:\n{}",
                r.body
            );
            assert!(
                r.body
                    .lines()
                    .any(|l| !l.starts_with('#') && l.starts_with(name)),
                "{format}: no sample of {name}:\n{}",
                r.body
            );
        }
    }
}
