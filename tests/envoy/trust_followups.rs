//! Issue 22, items 2, 3 and 9, through a real Envoy: what one request leaves behind must not
//! send another request where it cannot be served, nor skew what the filter learns.
//!
//! - Item 2: a Responses API follow-up (`previous_response_id`) goes to the endpoint holding
//!   its state or is refused with a retryable 503, whatever the quota bookkeeping says of the
//!   holder; a follow-up that carries its whole input and is placed elsewhere reaches that
//!   endpoint without `previous_response_id` on its first attempt too (before: only failover
//!   copies had it removed, so the first attempt got `404 previous_response_not_found`).
//! - Item 3: a streamed answer served by a failover call is not a latency sample of its whole
//!   duration (before: a 1.5 s stream became a 1.5 s sample of the backup).
//! - Item 9: `expose_headers: false` names no endpoint in error bodies; `upstream_merged`
//!   model lists never relay a failed upstream answer.

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
use support::http::{self, Response};
use support::placement::{header_session, starts_with};
use support::{Envoy, EnvoyConfig, MockUpstream};

const H_ENDPOINT: &str = "x-computeflux-endpoint";

fn fleet(names: &[&str], args: &[&str], extra: Value) -> (Vec<MockUpstream>, Envoy) {
    let mocks: Vec<MockUpstream> = names
        .iter()
        .map(|n| MockUpstream::start(n, &["m1"], args))
        .collect();
    let endpoints: Vec<Value> = names
        .iter()
        .map(|n| json!({"name": n, "cluster": n, "models": ["m1"]}))
        .collect();
    let mut plugin = json!({
        "endpoints": endpoints,
        "max_attempts": 3,
        "tuning": {"retry_budget_min_retries": 1000},
        "rate_limit_ms": 60_000,
    });
    if let (Some(p), Value::Object(more)) = (plugin.as_object_mut(), extra) {
        p.extend(more);
    }
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    (mocks, envoy)
}

fn post(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    http::request(
        port,
        "POST",
        path,
        &[&[("content-type", "application/json")], headers].concat(),
        Some(body.as_bytes()),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

fn error_code(r: &Response) -> String {
    serde_json::from_str::<Value>(&r.body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn mock<'a>(mocks: &'a [MockUpstream], name: &str) -> &'a MockUpstream {
    mocks.iter().find(|m| m.name == name).unwrap()
}

/// A first Responses turn: (response id, endpoint that holds it).
fn first_turn(port: u16, text: &str) -> (String, String) {
    let r = post(
        port,
        "/v1/responses",
        &[],
        &json!({"model": "m1", "input": text}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    (id, r.header(H_ENDPOINT).unwrap().to_string())
}

/// Item 2: the holder is cooling down (its 429 to a follow-up). A plain follow-up gets a
/// retryable 503; a follow-up that replays its whole input goes elsewhere, and what that
/// endpoint receives on the first attempt has no `previous_response_id`, with a framing that
/// matches the new body. Before: the first attempt forwarded Envoy's buffered body unchanged,
/// and the new endpoint answered `404 previous_response_not_found`.
#[test]
fn a_whole_input_follow_up_placed_elsewhere_is_sent_without_previous_response_id() {
    let (mocks, envoy) = fleet(&["a", "b", "c"], &["--decode-ms", "0"], json!({}));
    let (id, holder) = first_turn(envoy.port, "hello");
    mock(&mocks, &holder).set_fault(json!({"mode": "status", "status": 429, "count": 1}));
    let follow = json!({"model": "m1", "previous_response_id": id, "input": "second"}).to_string();
    let r = post(envoy.port, "/v1/responses", &[], &follow);
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (429, Some(holder.as_str())),
        "the holder's own 429, not failed over: {}",
        r.body
    );
    // Cooling: a plain follow-up is refused with a retryable 503.
    let r = post(envoy.port, "/v1/responses", &[], &follow);
    assert_eq!(
        (r.status, error_code(&r).as_str()),
        (503, "previous_response_unavailable"),
        "{}",
        r.body
    );
    assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
    // The whole conversation as input: placed elsewhere, without the id.
    let whole = json!({
        "model": "m1",
        "input": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "third"},
        ],
        "previous_response_id": id,
    })
    .to_string();
    let before: Vec<u64> = mocks.iter().map(MockUpstream::request_count).collect();
    let r = post(envoy.port, "/v1/responses", &[], &whole);
    assert_eq!(r.status, 200, "{}", r.body);
    let served = r.header(H_ENDPOINT).unwrap().to_string();
    assert_ne!(served, holder);
    let after: Vec<u64> = mocks.iter().map(MockUpstream::request_count).collect();
    let sent: Vec<i64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| *a as i64 - *b as i64)
        .collect();
    assert_eq!(sent.iter().sum::<i64>(), 1, "one attempt: {sent:?}");
    let got = mock(&mocks, &served).requests();
    let last = got.last().unwrap();
    let bytes = last["body_bytes"].as_u64().unwrap();
    assert!(
        bytes > 0 && (bytes as usize) < whole.len(),
        "the endpoint got {bytes} bytes, the client sent {}",
        whole.len()
    );
}

/// Item 2: a holder the quota bookkeeping counts as spent (its last answer said 0 requests
/// left) still gets its follow-ups: nobody else has the state. Before: the follow-up was
/// placed on another key, which answered `404 previous_response_not_found`.
#[test]
fn a_follow_up_goes_to_its_holder_even_when_its_quota_looks_spent() {
    let (mocks, envoy) = fleet(
        &["a", "b", "c"],
        &["--decode-ms", "0"],
        json!({"quota_aware": true}),
    );
    for m in &mocks {
        m.set_quota(json!({"requests": 2, "window_ms": 600_000, "headers_family": "openai"}));
    }
    let (id, holder) = first_turn(envoy.port, "hello");
    // A second first turn on the holder's key: its answer says 0 requests left.
    let mut spent = false;
    for i in 0..40 {
        let r = post(
            envoy.port,
            "/v1/responses",
            &[],
            &json!({"model": "m1", "input": format!("other {i}")}).to_string(),
        );
        if r.header(H_ENDPOINT) == Some(holder.as_str()) {
            assert_eq!(r.status, 200, "{}", r.body);
            spent = true;
            break;
        }
    }
    assert!(spent, "no other conversation landed on {holder}");
    // The mock answers a spent key's request with 429; refill it so that the follow-up can be
    // served, without telling the filter (which still believes 0 requests are left).
    mock(&mocks, &holder)
        .set_quota(json!({"requests": 5, "window_ms": 600_000, "headers_family": "openai"}));
    let follow = json!({"model": "m1", "previous_response_id": id, "input": "second"}).to_string();
    let r = post(envoy.port, "/v1/responses", &[], &follow);
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some(holder.as_str())),
        "{}",
        r.body
    );
}

/// Item 3: `b` serves a 1.5 s streamed generation as the failover of `a`'s 429. Its latency
/// estimate stays near its time to first byte (a few ms), as after a stream served directly.
/// Before: the whole answer's duration was the sample (about 1.5 s).
#[test]
fn a_streamed_failover_answer_is_not_a_whole_duration_latency_sample() {
    let (mocks, envoy) = fleet(
        &["a", "b"],
        &["--prefill-us-per-token", "0", "--decode-ms", "1500"],
        json!({"tuning": {"pin_break_ratio": 1000.0}}),
    );
    let weights = [("a", 1.0), ("b", 1.0)];
    let session = (0..1000)
        .map(|i| format!("s-{i}"))
        .find(|s| starts_with(header_session(s), &weights, &["a", "b"]))
        .unwrap();
    let latency = |name: &str| {
        envoy
            .stat(&format!(
                "wasmcustom.computeflux_ewma_latency_ms.endpoint.{name}"
            ))
            .unwrap_or(0)
    };
    let stream = |turn: &str| {
        post(
            envoy.port,
            "/v1/chat/completions",
            &[("x-session-id", &session)],
            &json!({"model": "m1", "stream": true,
                    "messages": [{"role": "user", "content": turn}]})
            .to_string(),
        )
    };
    mock(&mocks, "a").set_fault(json!({"mode": "status", "status": 500, "count": 1}));
    let r = stream("turn 1");
    assert_eq!(
        (
            r.status,
            r.header(H_ENDPOINT),
            r.header("x-computeflux-attempts")
        ),
        (200, Some("b"), Some("2")),
        "{}",
        r.body
    );
    let after_failover = latency("b");
    // The session is now pinned to b: a stream served directly, timed to its first byte.
    let r = stream("turn 2");
    assert_eq!((r.status, r.header(H_ENDPOINT)), (200, Some("b")));
    let direct = latency("b");
    println!("b's latency estimate: after the failover {after_failover} ms, then {direct} ms");
    assert!(
        after_failover < 300,
        "a 1.5 s stream served by a failover call became a {after_failover} ms sample"
    );
    assert!(direct < 300, "{direct}");
}

/// Item 9: with `expose_headers: false` no error body names an endpoint. Before: a failover
/// call refused by the next endpoint answered "Endpoint gpu-beta is unavailable …", and a
/// follow-up whose holder cools down "… is stored by endpoint gpu-alpha …".
#[test]
fn hidden_endpoint_names_stay_out_of_error_bodies() {
    let names = ["gpu-alpha", "gpu-beta"];
    let (mocks, envoy) = fleet(
        &names,
        &["--decode-ms", "0"],
        json!({"expose_headers": false, "max_attempts": 2}),
    );
    let leaks = |r: &Response| names.iter().any(|n| r.body.contains(n));
    // Both refuse connections: the routed attempt and the failover call get Envoy's own 503.
    let chat = json!({"model": "m1", "messages": [{"role": "user", "content": "hi"}]});
    for m in &mocks {
        m.set_fault(json!({"mode": "refuse"}));
    }
    let r = post(envoy.port, "/v1/chat/completions", &[], &chat.to_string());
    assert!(r.status >= 500, "{} {}", r.status, r.body);
    assert!(!leaks(&r), "names an endpoint: {}", r.body);
    for m in &mocks {
        m.clear_fault();
    }
    // A Responses follow-up whose holder is rate limited.
    let r = post(
        envoy.port,
        "/v1/responses",
        &[],
        &json!({"model": "m1", "input": "hello"}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    for m in &mocks {
        m.set_fault(json!({"mode": "status", "status": 429, "count": 1}));
    }
    let follow = json!({"model": "m1", "previous_response_id": id, "input": "again"}).to_string();
    let r = post(envoy.port, "/v1/responses", &[], &follow);
    assert_eq!(r.status, 429, "{}", r.body);
    let r = post(envoy.port, "/v1/responses", &[], &follow);
    assert_eq!(
        (r.status, error_code(&r).as_str()),
        (503, "previous_response_unavailable"),
        "{}",
        r.body
    );
    // (The mock's response ids carry its name; the filter's words must not.)
    let words = r.body.replace(&id, "");
    assert!(
        !names.iter().any(|n| words.contains(n)),
        "names an endpoint: {}",
        r.body
    );
}

/// Item 9: `list_models: upstream_merged` when the upstream fails (500) or the call is refused
/// (the endpoint's cluster is unknown to Envoy): the configured models, 200. Before: the 500
/// was relayed, and a refused call let the request through without a cluster.
#[test]
fn a_merged_model_list_never_relays_a_failed_upstream_answer() {
    let (mocks, envoy) = fleet(
        &["a", "b"],
        &["--decode-ms", "0"],
        json!({"list_models": "upstream_merged"}),
    );
    for m in &mocks {
        m.set_fault(json!({"mode": "status", "status": 500}));
    }
    let r = http::get(envoy.port, "/v1/models");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"][0]["id"], "m1", "{}", r.body);
    drop(envoy);
    // An endpoint whose cluster Envoy does not know: every call is refused.
    let ghost = MockUpstream::start("ghost", &["m1"], &[]);
    let plugin = json!({
        "endpoints": [{"name": "ghost", "cluster": "no-such-cluster", "models": ["m9"]}],
        "list_models": "upstream_merged",
    });
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &[("ghost", ghost.port)]));
    let r = http::get(envoy.port, "/v1/models");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"][0]["id"], "m9", "{}", r.body);
}
