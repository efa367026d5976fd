//! The official OpenAI Python SDK through a real Envoy with the filter, against mock upstreams.
//!
//! Each test starts its own fleet (mocks serving given models, Envoy with the filter in front),
//! runs one scenario of `tests/sdk/scenarios.py` (which asserts what the SDK alone can judge:
//! types, error classes, retries) and then asserts the routing: which endpoint answered, what
//! the mocks received. The SDK is installed into `.venv` by `scripts/lib/ensure-python-sdk`
//! (run by `scripts/test`).
//!

// A test fails loudly: panics with context are the point here.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::python::run_scenario;
use support::{Envoy, EnvoyConfig, MockUpstream};

const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);

/// Mocks and the Envoy in front of them; everything is stopped (by PID) when dropped.
struct Fleet {
    mocks: Vec<MockUpstream>,
    envoy: Envoy,
}

impl Fleet {
    /// One mock per `(name, models)`, each an endpoint of the same name serving those models
    /// (the mock refuses others with 404, like a real server); `extra` is merged into the
    /// plugin configuration.
    fn start(endpoints: &[(&str, &[&str])], extra: Value) -> Fleet {
        let mocks: Vec<MockUpstream> = endpoints
            .iter()
            .map(|(name, models)| MockUpstream::start(name, models, &["--decode-ms", "5"]))
            .collect();
        let eps: Vec<Value> = endpoints
            .iter()
            .map(|(name, models)| json!({"name": name, "cluster": name, "models": models}))
            .collect();
        let mut plugin = json!({ "endpoints": eps });
        if let (Some(p), Value::Object(more)) = (plugin.as_object_mut(), extra) {
            p.extend(more);
        }
        let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
        let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
        Fleet { mocks, envoy }
    }

    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.envoy.port)
    }

    fn run(&self, scenario: &str, args: Value) -> Value {
        run_scenario(scenario, &self.base_url(), &args, SCENARIO_TIMEOUT).findings()
    }

    fn mock(&self, name: &str) -> &MockUpstream {
        self.mocks
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("no mock {name}"))
    }

    /// `(path, model, status)` of every request a mock received.
    fn received(&self, name: &str) -> Vec<(String, String, u64)> {
        self.mock(name)
            .requests()
            .iter()
            .map(|r| {
                (
                    r["path"].as_str().unwrap_or("").to_string(),
                    r["model"].as_str().unwrap_or("").to_string(),
                    r["status"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    }
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

#[test]
fn sdk_chat_completion_turns_stick_to_one_endpoint() {
    let fleet = Fleet::start(&[("a", &["llama"]), ("b", &["llama"])], json!({}));
    let out = fleet.run("chat", json!({"model": "llama"}));
    let first = str_at(&out, "/turns/0/endpoint");
    assert!(first == "a" || first == "b", "{out}");
    assert_eq!(str_at(&out, "/turns/1/endpoint"), first, "{out}");
    assert_eq!(str_at(&out, "/turns/0/affinity"), "home");
    assert_eq!(str_at(&out, "/turns/1/affinity"), "hit");
    // The answer really came from that endpoint, for that model.
    assert!(str_at(&out, "/turns/1/text").starts_with(&format!("[{first}]")));
    assert_eq!(str_at(&out, "/turns/0/model"), "llama");
    assert_eq!(fleet.mock(first).request_count(), 2);
}

#[test]
fn sdk_streaming_chat_completion() {
    let fleet = Fleet::start(&[("a", &["llama"])], json!({}));
    let out = fleet.run("stream", json!({"model": "llama"}));
    // 16 completion tokens, one per chunk, plus the role, finish and usage chunks.
    assert_eq!(out["completion_tokens"], 16, "{out}");
    assert_eq!(out["chunks"], 19, "{out}");
    assert!(str_at(&out, "/text").starts_with("[a] w1 w2"), "{out}");
}

#[test]
fn sdk_embeddings_routed_by_model() {
    let fleet = Fleet::start(&[("chat", &["llama"]), ("emb", &["embedder"])], json!({}));
    let out = fleet.run("embeddings", json!({"model": "embedder"}));
    assert_eq!(str_at(&out, "/endpoint"), "emb", "{out}");
    assert_eq!(str_at(&out, "/model"), "embedder");
    assert_eq!(out["dims"], 8);
    let received = fleet.received("emb");
    assert_eq!(received.len(), 3, "{received:?}");
    assert!(received
        .iter()
        .all(|(p, m, s)| p == "/v1/embeddings" && m == "embedder" && *s == 200));
    assert!(fleet.received("chat").is_empty());
}

#[test]
fn sdk_models_list_shows_every_model_of_the_fleet() {
    let fleet = Fleet::start(
        &[("a", &["llama", "qwen"]), ("b", &["qwen", "whisper-1"])],
        json!({}),
    );
    let out = fleet.run("models", json!({}));
    assert_eq!(out["ids"], json!(["llama", "qwen", "whisper-1"]), "{out}");
    // Answered by the filter: no upstream saw it.
    assert!(fleet.received("a").is_empty() && fleet.received("b").is_empty());
}

#[test]
fn sdk_transcription_upload_routed_by_its_form_model() {
    let fleet = Fleet::start(
        &[("chat", &["llama"]), ("audio", &["whisper-1"])],
        json!({}),
    );
    let out = fleet.run("transcription", json!({"model": "whisper-1"}));
    assert_eq!(str_at(&out, "/endpoint"), "audio", "{out}");
    assert_eq!(
        str_at(&out, "/text"),
        "[audio] transcribed 16384 bytes with whisper-1"
    );
    assert_eq!(
        fleet.received("audio"),
        [("/v1/audio/transcriptions".into(), "whisper-1".into(), 200)]
    );
}

#[test]
fn sdk_responses_follow_ups_reach_the_endpoint_holding_the_state() {
    let fleet = Fleet::start(&[("a", &["m"]), ("b", &["m"]), ("c", &["m"])], json!({}));
    let out = fleet.run("responses", json!({"model": "m", "turns": 5}));
    let turns = out["turns"].as_array().expect("turns");
    assert_eq!(turns.len(), 5);
    let holder = str_at(&out, "/turns/0/endpoint");
    for (i, t) in turns.iter().enumerate() {
        assert_eq!(str_at(t, "/endpoint"), holder, "turn {}: {out}", i + 1);
        // The holder continued its stored conversation: it counts the turns.
        let text = str_at(t, "/text");
        assert!(
            text.starts_with(&format!("[{holder}] turn={}", i + 1)),
            "turn {}: {text}",
            i + 1
        );
    }
    let others: usize = ["a", "b", "c"]
        .iter()
        .filter(|n| **n != holder)
        .map(|n| fleet.received(n).len())
        .sum();
    assert_eq!(others, 0, "follow-ups reached other endpoints");
}

#[test]
fn sdk_error_classes_and_retry_after() {
    let max_body_bytes = 65_536;
    let fleet = Fleet::start(
        &[("solo", &["m"])],
        json!({"max_body_bytes": max_body_bytes}),
    );
    let control = fleet.mock("solo").control_port;
    let out = fleet.run(
        "errors",
        json!({"model": "m", "max_body_bytes": max_body_bytes, "control_port": control}),
    );
    // The filter's own answers.
    assert_eq!(
        out["400"],
        json!({"status": 400, "code": "missing_model", "type": "invalid_request_error"})
    );
    assert_eq!(
        out["404"],
        json!({"status": 404, "code": "model_not_found"})
    );
    assert_eq!(
        out["413"],
        json!({"status": 413, "code": "request_too_large", "class": "APIStatusError"})
    );
    // The upstream's, passed through with its Retry-After.
    assert_eq!(out["429"], json!({"status": 429, "retry_after": "1"}));
    assert_eq!(out["503"], json!({"status": 503}));
    // The SDK waited as long as Retry-After said (2 s; its own first backoff is ≤ 0.5 s).
    let elapsed = out["429_retried"]["elapsed_s"].as_f64().expect("elapsed");
    assert!(elapsed >= 1.9, "retried after {elapsed} s: {out}");
    assert!(
        out["429_retried"]["retries_taken"].as_u64() >= Some(1),
        "{out}"
    );
    assert_eq!(out["503_retried"]["retries_taken"], 1, "{out}");
    // What reached the upstream: each injected failure once, and each SDK retry's success
    // (the filter answered 400/404/413 itself; any 429 it answered while the endpoint cooled
    // down never reached it).
    let statuses: Vec<u64> = fleet.received("solo").iter().map(|r| r.2).collect();
    assert_eq!(statuses, [503, 503, 200, 429, 429, 200], "{out}");
}

/// `pin_cookie` with the SDK's own HTTP client: a conversation failed over by one Envoy replica
/// (its home answered 429) continues on the backup through a second replica that never saw the
/// failover, because the client sends back the cookie the failover answer set (its first
/// answer, at home, set one too; the failover's replaced it under the same name). The same turn
/// without the cookie goes home on that replica.
#[test]
fn sdk_keeps_the_pin_cookie_across_replicas() {
    let endpoints: [(&str, &[&str]); 3] = [("a", &["llama"]), ("b", &["llama"]), ("c", &["llama"])];
    // `pin_cookie` is on by default: both Envoys run the same default configuration (and so
    // derive the same cookie key).
    let fleet = Fleet::start(&endpoints, json!({}));
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(name, models)| json!({"name": name, "cluster": name, "models": models}))
        .collect();
    let clusters: Vec<(&str, u16)> = fleet
        .mocks
        .iter()
        .map(|m| (m.name.as_str(), m.port))
        .collect();
    let other = Envoy::start(EnvoyConfig::new(json!({"endpoints": eps}), &clusters));
    let control_ports: serde_json::Map<String, Value> = fleet
        .mocks
        .iter()
        .map(|m| (m.name.clone(), json!(m.control_port)))
        .collect();
    let out = fleet.run(
        "pin_cookie",
        json!({
            "model": "llama",
            "other_base_url": format!("http://127.0.0.1:{}/v1", other.port),
            "control_ports": control_ports,
        }),
    );
    let home = str_at(&out, "/home");
    assert_eq!(str_at(&out, "/turns/0/affinity"), "home", "{out}");
    // Every successful answer tells the client where its session is, at home too.
    assert!(
        str_at(&out, "/turns/0/set_cookie").starts_with("cf_pin_"),
        "a cookie at home: {out}"
    );
    let backup = str_at(&out, "/turns/1/endpoint");
    assert_ne!(backup, home, "{out}");
    assert!(
        str_at(&out, "/turns/1/set_cookie").starts_with("cf_pin_"),
        "{out}"
    );
    assert_eq!(out["cookies"].as_array().map(Vec::len), Some(1), "{out}");
    // The other replica: home without the cookie, the backup (as a pin hit) with it.
    assert_eq!(str_at(&out, "/control"), home, "{out}");
    assert_eq!(str_at(&out, "/turns/2/endpoint"), backup, "{out}");
    assert_eq!(str_at(&out, "/turns/2/affinity"), "hit", "{out}");
}
