//! Usage accounting (issue 12, item 1) through a real Envoy in front of two mock endpoints.
//!
//! What must hold: the filter's token counters (`computeflux_{prompt,cached_prompt,
//! completion}_tokens_total{endpoint,affinity}`) equal what the mocks themselves counted, for
//! JSON and streamed answers, per endpoint and per affinity result (each answer's own tokens and
//! affinity are in its `x-mock-*` and `x-computeflux-affinity` headers); a stream cut mid-way and
//! an answer without `usage` add nothing, although the mock counted them; a failover answer,
//! relayed whole, counts for the endpoint that gave it; `usage_accounting: false` counts nothing.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use computeflux::scheduler::AffinityResult;
use serde_json::{json, Value};
use support::http::try_post_chat;
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream, Response};

const ENDPOINTS: [&str; 2] = ["a", "b"];
const MODEL: &str = "m1";
const KINDS: [&str; 3] = ["prompt", "cached_prompt", "completion"];

/// `(kind, endpoint, affinity) -> tokens`.
type Tokens = BTreeMap<(String, String, String), u64>;

struct Setup {
    mocks: Vec<MockUpstream>,
    envoy: Envoy,
}

fn setup(extra: Value) -> Setup {
    let mocks: Vec<MockUpstream> = ENDPOINTS
        .iter()
        .map(|n| {
            MockUpstream::start(
                n,
                &[],
                &["--prefill-us-per-token", "10", "--decode-ms", "20"],
            )
        })
        .collect();
    let endpoints: Vec<Value> = ENDPOINTS
        .iter()
        .map(|n| json!({"name": n, "cluster": n}))
        .collect();
    let mut plugin = json!({"endpoints": endpoints});
    if let (Some(p), Value::Object(keys)) = (plugin.as_object_mut(), extra) {
        p.extend(keys);
    }
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    Setup { mocks, envoy }
}

impl Setup {
    fn mock(&self, name: &str) -> &MockUpstream {
        self.mocks.iter().find(|m| m.name == name).unwrap()
    }
}

/// The filter's token counters, from admin `/stats` (zero series included).
fn tokens(envoy: &Envoy) -> Tokens {
    let body = envoy.admin_get("/stats?format=json").body;
    let v: Value = serde_json::from_str(&body).unwrap();
    let mut out = Tokens::new();
    for s in v["stats"].as_array().unwrap() {
        let Some(name) = s.get("name").and_then(Value::as_str) else {
            continue;
        };
        for kind in KINDS {
            let prefix = format!("wasmcustom.computeflux_{kind}_tokens_total.endpoint.");
            if let Some(rest) = name.strip_prefix(&prefix) {
                let (endpoint, affinity) = rest.split_once(".affinity.").unwrap();
                let value = s["value"].as_u64().unwrap();
                out.insert((kind.into(), endpoint.into(), affinity.into()), value);
            }
        }
    }
    out
}

/// Sums `t` over the keys `keep` accepts.
fn sum(t: &Tokens, keep: impl Fn(&str, &str, &str) -> bool) -> u64 {
    t.iter()
        .filter(|((k, e, a), _)| keep(k, e, a))
        .map(|(_, v)| *v)
        .sum()
}

/// `after − before`, dropping zeros.
fn delta(before: &Tokens, after: &Tokens) -> Tokens {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// The mock's own counters: `kind -> tokens`.
fn mock_tokens(m: &MockUpstream) -> BTreeMap<&'static str, u64> {
    let s = m.stats();
    BTreeMap::from([
        ("prompt", s["prompt_tokens"].as_u64().unwrap()),
        ("cached_prompt", s["cached_tokens"].as_u64().unwrap()),
        ("completion", s["completion_tokens"].as_u64().unwrap()),
    ])
}

/// What one answer should add: its tokens from the mock's headers (prompt, cached) and its
/// body (completion), under the endpoint and affinity the filter reported.
fn expected(r: &Response, completion: u64, into: &mut Tokens) {
    let h = |n: &str| {
        r.header(n)
            .unwrap_or_else(|| panic!("no {n}: {:?}", r.headers))
    };
    let key = |k: &str| {
        (
            k.to_string(),
            h("x-computeflux-endpoint").to_string(),
            h("x-computeflux-affinity").to_string(),
        )
    };
    for (kind, v) in [
        ("prompt", h("x-mock-prompt-tokens").parse::<u64>().unwrap()),
        ("cached_prompt", h("x-mock-cached-tokens").parse().unwrap()),
        ("completion", completion),
    ] {
        if v > 0 {
            *into.entry(key(kind)).or_insert(0) += v;
        }
    }
}

/// The completion tokens of an answer, as its body says.
fn completion_of(r: &Response, stream: bool) -> u64 {
    let usage = if stream {
        let data = r.sse_data();
        let usage_event = data
            .iter()
            .rev()
            .find(|d| d.contains("\"usage\""))
            .unwrap_or_else(|| panic!("no usage event: {}", r.body));
        serde_json::from_str::<Value>(usage_event).unwrap()["usage"].clone()
    } else {
        r.json()["usage"].clone()
    };
    usage["completion_tokens"].as_u64().unwrap()
}

/// Turn `turn` (1-based) of session `s`.
fn send(port: u16, s: &str, turn: usize, stream: bool) -> Response {
    let msgs: Vec<String> = (1..=turn)
        .map(|t| format!("session {s} turn {t}: please consider this fairly long question text"))
        .collect();
    let refs: Vec<&str> = msgs.iter().map(String::as_str).collect();
    let body = chat_body(MODEL, &refs, json!({"stream": stream}));
    post_chat(port, &[("x-session-id", s)], &body)
}

/// Waits (≤ 5 s) until `f` holds of the counters; returns the last reading.
fn settle(envoy: &Envoy, f: impl Fn(&Tokens) -> bool) -> Tokens {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let t = tokens(envoy);
        if f(&t) || Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn token_metrics_equal_the_mocks_counters_per_endpoint_and_affinity() {
    let st = setup(json!({}));
    let port = st.envoy.port;
    let before = tokens(&st.envoy);
    assert_eq!(
        before.len(),
        KINDS.len() * ENDPOINTS.len() * AffinityResult::ALL.len(),
        "one series per kind, endpoint and affinity result: {before:?}"
    );
    let mut want = Tokens::new();
    let (mut json_answers, mut streams) = (0, 0);
    for s in 0..8 {
        for turn in 1..=3 {
            let stream = (s + turn) % 2 == 0;
            let r = send(port, &format!("u{s}"), turn, stream);
            assert_eq!(r.status, 200, "{}", r.body);
            expected(&r, completion_of(&r, stream), &mut want);
            if stream {
                streams += 1;
            } else {
                json_answers += 1;
            }
        }
    }
    let got = settle(&st.envoy, |t| delta(&before, t) == want);
    let got = delta(&before, &got);
    println!("{json_answers} JSON answers and {streams} streams; counted: {got:?}");
    assert_eq!(got, want, "per (kind, endpoint, affinity)");
    for m in &st.mocks {
        for (kind, v) in mock_tokens(m) {
            let counted = sum(&got, |k, e, _| k == kind && e == m.name);
            assert_eq!(counted, v, "{kind} tokens of endpoint {}", m.name);
        }
    }
    // The affinity paid: later turns were hits, with cached prompt tokens.
    let hit_cached = sum(&got, |k, _, a| k == "cached_prompt" && a == "hit");
    let hit_prompt = sum(&got, |k, _, a| k == "prompt" && a == "hit");
    println!("affinity hits: {hit_cached} of {hit_prompt} prompt tokens cached");
    assert!(hit_cached > 0 && hit_cached < hit_prompt);
    // The `affinity` label reaches Prometheus.
    let prom = st.envoy.prometheus();
    assert!(
        prom.lines()
            .any(|l| l.starts_with("computeflux_cached_prompt_tokens_total{")
                && l.contains("affinity=\"hit\"")
                && l.contains("endpoint=\"")),
        "no labelled token series in:\n{prom}"
    );
}

#[test]
fn cut_streams_and_answers_without_usage_are_not_counted() {
    let st = setup(json!({}));
    let port = st.envoy.port;
    let first = send(port, "cut", 1, false);
    assert_eq!(first.status, 200);
    let home = first.header("x-computeflux-endpoint").unwrap().to_string();
    let mock = st.mock(&home);
    let before = settle(&st.envoy, |t| sum(t, |k, _, _| k == "prompt") > 0);
    let mock_before = mock_tokens(mock);

    // A stream cut mid-way: the client sees it cut.
    mock.set_fault(json!({"mode": "cut", "count": 1}));
    match try_post_chat(
        port,
        &[("x-session-id", "cut")],
        &chat_body(MODEL, &["cut", "stream me"], json!({"stream": true})),
    ) {
        Ok(r) => assert!(!r.body.contains("[DONE]"), "not cut: {}", r.body),
        Err(e) => println!("cut stream: {e}"),
    }
    // Answers without usage, JSON and streamed.
    mock.set_fault(json!({"mode": "no_usage", "count": 2}));
    let r = send(port, "cut", 3, false);
    assert_eq!(r.status, 200);
    assert!(r.json().get("usage").is_none(), "{}", r.body);
    let r = send(port, "cut", 4, true);
    assert_eq!(r.status, 200);
    assert!(r.body.contains("[DONE]") && !r.body.contains("\"usage\""));
    let faults: Vec<String> = mock
        .requests()
        .iter()
        .filter_map(|q| q["fault"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        faults,
        ["cut", "no_usage", "no_usage"],
        "the faults were served"
    );
    let mock_after = mock_tokens(mock);
    assert!(
        mock_after["prompt"] > mock_before["prompt"],
        "the mock counted them: {mock_before:?} -> {mock_after:?}"
    );

    // A normal turn after them is counted, exactly.
    let r = send(port, "cut", 5, true);
    assert_eq!(r.status, 200);
    let mut want = Tokens::new();
    expected(&r, completion_of(&r, true), &mut want);
    let after = settle(&st.envoy, |t| delta(&before, t) == want);
    assert_eq!(
        delta(&before, &after),
        want,
        "only the last, complete answer was counted"
    );
}

#[test]
fn failover_answers_count_for_the_endpoint_that_gave_them() {
    let st = setup(json!({}));
    let port = st.envoy.port;
    let first = send(port, "f", 1, false);
    let home = first.header("x-computeflux-endpoint").unwrap().to_string();
    let other = ENDPOINTS.iter().find(|e| **e != home).unwrap().to_string();
    let before = settle(&st.envoy, |t| sum(t, |k, _, _| k == "prompt") > 0);
    let other_before = mock_tokens(st.mock(&other));
    let mut want = Tokens::new();
    // The session's endpoint fails once; the other one's answer is relayed (a stream, then a
    // JSON answer). The session stays where it was served, so the failing side alternates.
    let mut from = home.clone();
    for (turn, stream) in [(2, true), (3, false)] {
        let to = ENDPOINTS.iter().find(|e| **e != from).unwrap().to_string();
        st.mock(&from)
            .set_fault(json!({"mode": "status", "status": 503, "count": 1}));
        let r = send(port, "f", turn, stream);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-computeflux-attempts"), Some("2"));
        assert_eq!(r.header("x-computeflux-endpoint"), Some(to.as_str()));
        expected(&r, completion_of(&r, stream), &mut want);
        from = to;
    }
    let after = settle(&st.envoy, |t| delta(&before, t) == want);
    let got = delta(&before, &after);
    assert_eq!(got, want);
    // The first failover answer (a stream) came from `other`: the mock agrees on it.
    let other_after = mock_tokens(st.mock(&other));
    for kind in KINDS {
        let counted = sum(&got, |k, e, _| k == kind && e == other);
        assert_eq!(counted, other_after[kind] - other_before[kind], "{kind}");
    }
    assert!(sum(&got, |k, e, _| k == "prompt" && e == home) > 0);
}

#[test]
fn usage_accounting_off_counts_nothing() {
    let st = setup(json!({"usage_accounting": false}));
    for turn in 1..=2 {
        for stream in [false, true] {
            assert_eq!(send(st.envoy.port, "off", turn, stream).status, 200);
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let t = tokens(&st.envoy);
    assert!(!t.is_empty(), "the series exist");
    assert_eq!(sum(&t, |_, _, _| true), 0, "{t:?}");
    assert!(
        st.mocks
            .iter()
            .map(|m| mock_tokens(m)["prompt"])
            .sum::<u64>()
            > 0
    );
}
