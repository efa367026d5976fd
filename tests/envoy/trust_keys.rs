//! Issue 22, items 4, 5 and 6, through a real Envoy: what a client can put in a request (a
//! cookie, a large image) must not decide where other sessions go, and an endpoint is judged
//! against the endpoints that would take its sessions.
//!
//! - Item 6: the pin cookie is signed. A cookie the filter did not issue (today's unsigned
//!   form, a tampered endpoint id, another session's cookie) is ignored and counted in
//!   `computeflux_pin_cookies_ignored_total`; before, any of them steered the session to the
//!   endpoint it named. A Responses conversation of 50 turns leaves a bounded cookie jar;
//!   before, most turns added a cookie of a new name.
//! - Item 4: in a fleet with a small and a large model, the large model's endpoints, uniformly
//!   slower, are never degraded; a truly slow one among them is.
//! - Item 5: a request with a large base64 image does not drain the key's remembered token
//!   count, so the sessions pinned to that key stay; before, its body bytes were taken for
//!   prompt tokens and the next pinned turn moved (a "certain 429" that was not).

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::support;

use std::time::Duration;

use computeflux::scheduler::routing::pins::pin_cookie;
use computeflux::scheduler::state::hash::endpoint_id;
use serde_json::{json, Value};
use support::http::{self, CookieJar, Response};
use support::placement::{header_session, starts_with};
use support::{
    chat_body, for_each_parallel, post_chat, tally, Envoy, EnvoyConfig, MockUpstream, Session,
};

const H_ENDPOINT: &str = "x-computeflux-endpoint";
const H_AFFINITY: &str = "x-computeflux-affinity";
/// The pin cookies one client may hold at once (`pin_cookie`'s slots).
const MAX_PIN_COOKIES: usize = 8;
const FAST: [&str; 4] = ["--prefill-us-per-token", "0", "--decode-ms", "0"];

struct Fleet {
    mocks: Vec<MockUpstream>,
    envoy: Envoy,
}

/// `a`, `b`, `c` serving `m1`, with `extra` plugin keys.
fn fleet(extra: Value) -> Fleet {
    let mocks: Vec<MockUpstream> = ["a", "b", "c"]
        .iter()
        .map(|n| MockUpstream::start(n, &["m1"], &FAST))
        .collect();
    let mut plugin = json!({
        "endpoints": [
            {"name": "a", "cluster": "a", "models": ["m1"]},
            {"name": "b", "cluster": "b", "models": ["m1"]},
            {"name": "c", "cluster": "c", "models": ["m1"]},
        ],
        "max_attempts": 3,
        "tuning": {"retry_budget_min_retries": 1000},
        "rate_limit_ms": 60_000,
    });
    if let (Some(p), Value::Object(more)) = (plugin.as_object_mut(), extra) {
        p.extend(more);
    }
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    Fleet { mocks, envoy }
}

impl Fleet {
    fn mock(&self, name: &str) -> &MockUpstream {
        self.mocks.iter().find(|m| m.name == name).unwrap()
    }
}

const EQUAL: [(&str, f64); 3] = [("a", 1.0), ("b", 1.0), ("c", 1.0)];

/// A session id (sent as `x-session-id`, no credentials) whose rendezvous home is `home`.
fn session_homed_on(home: &str, tag: &str) -> String {
    (0..10_000)
        .map(|i| format!("{tag}-{i}"))
        .find(|id| starts_with(header_session(id), &EQUAL, &[home]))
        .unwrap()
}

fn turn(port: u16, session: &str, n: usize, cookie: Option<&str>) -> Response {
    let mut headers = vec![("x-session-id", session)];
    if let Some(c) = cookie {
        headers.push(("cookie", c));
    }
    let msgs: Vec<String> = (1..=n).map(|i| format!("turn {i} of {session}")).collect();
    let msgs: Vec<&str> = msgs.iter().map(String::as_str).collect();
    post_chat(port, &headers, &chat_body("m1", &msgs, Value::Null))
}

fn ignored(envoy: &Envoy, reason: &str) -> i64 {
    envoy
        .stat(&format!(
            "wasmcustom.computeflux_pin_cookies_ignored_total.reason.{reason}"
        ))
        .unwrap_or(0)
}

/// Item 6: cookies the filter did not sign do not steer. Before: an unsigned cookie naming `c`
/// sent session S (home `a`) to `c`; a real cookie with its endpoint id edited went where the
/// edit said; another session's cookie, renamed, moved S as well.
#[test]
fn pin_cookies_the_filter_did_not_sign_do_not_steer_sessions() {
    let f = fleet(json!({}));
    let port = f.envoy.port;

    // Unsigned: today's form, `cf_pin_<session>=<endpoint id>`, naming c.
    let s = session_homed_on("a", "forge");
    let key = header_session(&s);
    for value in [
        endpoint_id("c").to_string(),
        format!(
            "{key:016x}.{}.99999999999.{}",
            endpoint_id("c"),
            "0".repeat(32)
        ),
    ] {
        let cookie = format!("{}={value}", pin_cookie::name(key));
        let r = turn(port, &s, 1, Some(&cookie));
        assert_eq!(
            (r.status, r.header(H_ENDPOINT)),
            (200, Some("a")),
            "cookie {cookie}: {}",
            r.body
        );
    }
    assert!(ignored(&f.envoy, "unsigned") >= 1, "unsigned not counted");
    assert!(ignored(&f.envoy, "forged") >= 1, "forged not counted");

    // A real cookie: session T (home a) fails over once and is told where it went.
    let t = session_homed_on("a", "real");
    f.mock("a")
        .set_fault(json!({"mode": "status", "status": 503, "count": 1}));
    let r = turn(port, &t, 1, None);
    assert_eq!(r.status, 200, "{}", r.body);
    let backup = r.header(H_ENDPOINT).unwrap().to_string();
    assert_ne!(backup, "a");
    let mut jar = CookieJar::default();
    jar.store(&r);
    let real = jar.header().expect("a failover sets the pin cookie");
    // The real cookie is followed (by this replica it would be anyway; its pin is local too).
    let r = turn(port, &t, 2, Some(&real));
    assert_eq!(r.header(H_ENDPOINT), Some(backup.as_str()), "{}", r.body);

    // Tampered: the backup's id replaced by the third endpoint's.
    let third = ["b", "c"].into_iter().find(|e| *e != backup).unwrap();
    let tampered = real.replace(
        &endpoint_id(&backup).to_string(),
        &endpoint_id(third).to_string(),
    );
    assert_ne!(tampered, real);
    let forged_before = ignored(&f.envoy, "forged");
    let r = turn(port, &t, 3, Some(&tampered));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(
        r.header(H_ENDPOINT),
        Some(third),
        "a tampered cookie steered the session: {tampered}"
    );
    assert!(ignored(&f.envoy, "forged") > forged_before);

    // Another session's cookie: T's value under U's name does not move U (home a).
    let u = session_homed_on("a", "other");
    let (_, value) = real.split_once('=').unwrap();
    let borrowed = format!("{}={value}", pin_cookie::name(header_session(&u)));
    let r = turn(port, &u, 1, Some(&borrowed));
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some("a")),
        "another session's cookie moved U: {borrowed}"
    );
}

/// Item 6: a client that keeps one cookie jar over a 50-turn Responses conversation (an SDK
/// client) keeps at most a few pin cookies. Before, most turns set a cookie of a new name (the
/// session key of a follow-up is its `previous_response_id`), and the jar grew with every turn
/// towards Envoy's header limit.
#[test]
fn a_responses_conversation_keeps_a_bounded_cookie_jar() {
    let f = fleet(json!({}));
    let mut jar = CookieJar::default();
    let mut prev: Option<String> = None;
    let mut served = Vec::new();
    let mut largest = 0;
    for n in 1..=50 {
        let mut body = json!({"model": "m1", "input": format!("turn {n}"), "store": true});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let cookie = jar.header();
        let mut headers = vec![];
        if let Some(c) = cookie.as_deref() {
            headers.push(("cookie", c));
        }
        let r = http::request(
            f.envoy.port,
            "POST",
            "/v1/responses",
            &headers,
            Some(body.to_string().as_bytes()),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(r.status, 200, "turn {n}: {}", r.body);
        jar.store(&r);
        largest = largest.max(jar.header().map_or(0, |h| h.len()));
        served.push(r.header(H_ENDPOINT).unwrap_or("-").to_string());
        prev = r.json()["id"].as_str().map(str::to_string);
        assert!(prev.is_some(), "turn {n}: no id in {}", r.body);
    }
    let pins = jar.names().filter(|n| n.starts_with("cf_pin_")).count();
    eprintln!(
        "served by {:?}; pin cookies in the jar: {pins}; largest cookie header: {largest} bytes",
        tally(&served)
    );
    assert!(
        pins <= MAX_PIN_COOKIES,
        "{pins} pin cookies after 50 turns: {:?}",
        jar.names().collect::<Vec<_>>()
    );
    assert!(largest <= 1024, "cookie header of {largest} bytes");
}

/// Item 6: one client jar (an SDK client shared by many conversations) over 50 sessions that
/// all fail over from their home `a` (503) holds at most a few pin cookies. Before, each session
/// served away from home got a cookie of its own name.
#[test]
fn one_jar_over_50_failed_over_sessions_holds_a_bounded_set_of_pin_cookies() {
    let f = fleet(json!({"open_ms": 600_000}));
    f.mock("a")
        .set_fault(json!({"mode": "status", "status": 503}));
    let mut jar = CookieJar::default();
    let mut largest = 0;
    let mut away = 0;
    for n in 0..50 {
        let id = session_homed_on("a", &format!("jar{n}"));
        let r = turn(f.envoy.port, &id, 1, jar.header().as_deref());
        assert_eq!(r.status, 200, "session {n}: {}", r.body);
        away += usize::from(r.header(H_ENDPOINT) != Some("a"));
        jar.store(&r);
        largest = largest.max(jar.header().map_or(0, |h| h.len()));
    }
    let pins = jar.names().filter(|n| n.starts_with("cf_pin_")).count();
    eprintln!("{away}/50 served away from home; pin cookies in the jar: {pins}; largest cookie header: {largest} bytes");
    assert_eq!(away, 50);
    assert!(pins >= 1, "no pin cookie set");
    assert!(
        pins <= MAX_PIN_COOKIES,
        "{pins} pin cookies after 50 sessions: {:?}",
        jar.names().collect::<Vec<_>>()
    );
    assert!(largest <= 1024, "cookie header of {largest} bytes");
}

/// Item 5: a request with a large base64 image, from client X pinned to key `a`, does not drain
/// what the filter remembers of `a`'s token quota: client Y, pinned to `a`, stays. Before, the
/// image's bytes were counted as prompt tokens (bytes ÷ 4), the remembered count fell below
/// Y's next turn, and Y moved as if staying were a certain 429.
#[test]
fn a_large_base64_image_does_not_drain_the_keys_quota() {
    let f = fleet(json!({"quota_aware": true}));
    let a = f.mock("a");
    a.set_quota(json!({"tokens": 60_000, "requests": 10_000, "window_ms": 120_000, "headers_family": "openai"}));
    let port = f.envoy.port;
    // Y: long turns (~3 000 tokens each); X: a short first turn.
    let y = session_homed_on("a", "quota-y");
    let x = session_homed_on("a", "quota-x");
    let long = "the quick brown fox jumps over the lazy dog; ".repeat(270);
    let y_turn = |n: usize| {
        let mut msgs = vec![long.clone()];
        msgs.extend((2..=n).map(|i| format!("turn {i}")));
        let msgs: Vec<&str> = msgs.iter().map(String::as_str).collect();
        post_chat(
            port,
            &[("x-session-id", y.as_str())],
            &chat_body("m1", &msgs, Value::Null),
        )
    };
    let r = y_turn(1);
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some("a")),
        "{}",
        r.body
    );
    let r = turn(port, &x, 1, None);
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some("a")),
        "{}",
        r.body
    );
    let left: usize = r
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .expect("a states its remaining tokens");
    // An image whose base64 is, at 4 bytes a token, all but ~1 000 of what is left.
    let image = "A".repeat((left - 1000) * 4);
    let body = json!({
        "model": "m1",
        "messages": [
            {"role": "user", "content": "turn 1 of x"},
            {"role": "assistant", "content": "reply 1"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is in this picture?"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{image}")}},
            ]},
        ],
    });
    let r = post_chat(port, &[("x-session-id", x.as_str())], &body.to_string());
    assert_eq!(
        (r.status, r.header(H_ENDPOINT)),
        (200, Some("a")),
        "{}",
        r.body
    );
    for n in 2..=4 {
        let r = y_turn(n);
        assert_eq!(
            (r.status, r.header(H_ENDPOINT), r.header(H_AFFINITY)),
            (200, Some("a"), Some("hit")),
            "Y turn {n} moved off a: {}",
            r.body
        );
    }
    assert_eq!(a.count_429(), 0);
}

/// Item 4: endpoints are judged against their peers for the same model. `s1`, `s2` serve a
/// small model; `l1`, `l2`, `l3` a large one, every request 4× slower. Under mixed traffic no
/// large endpoint is degraded and no pin is broken; once `l3` is another 6× slower, it is
/// degraded and its peers are not.
#[test]
fn a_uniformly_slower_large_model_fleet_is_not_degraded_a_slow_one_among_it_is() {
    const PREFILL: &str = "750";
    let small: Vec<MockUpstream> = ["s1", "s2"]
        .iter()
        .map(|n| {
            MockUpstream::start(
                n,
                &["small"],
                &["--prefill-us-per-token", PREFILL, "--decode-ms", "5"],
            )
        })
        .collect();
    let large: Vec<MockUpstream> = ["l1", "l2", "l3"]
        .iter()
        .map(|n| {
            MockUpstream::start(
                n,
                &["large"],
                &[
                    "--prefill-us-per-token",
                    PREFILL,
                    "--decode-ms",
                    "5",
                    "--slow-factor",
                    "4",
                    "--slow-after-ms",
                    "0",
                ],
            )
        })
        .collect();
    let mut endpoints = Vec::new();
    for m in &small {
        endpoints.push(json!({"name": m.name, "cluster": m.name, "models": ["small"]}));
    }
    for m in &large {
        endpoints.push(json!({"name": m.name, "cluster": m.name, "models": ["large"]}));
    }
    let plugin = json!({
        "endpoints": endpoints,
        "cold_start_samples": 5,
        "tuning": {"degraded_probe_interval_ms": 1000},
    });
    let clusters: Vec<(&str, u16)> = small
        .iter()
        .chain(&large)
        .map(|m| (m.name.as_str(), m.port))
        .collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    let degraded = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.computeflux_degraded.endpoint.{name}"))
            .unwrap_or(0)
    };
    let mut sessions: Vec<Session> = Session::many("small", 24, "small");
    sessions.extend(Session::many("large", 24, "large"));
    let port = envoy.port;
    let rounds = |sessions: &mut Vec<Session>, n: usize| {
        for _ in 0..n {
            for_each_parallel(sessions, 4, |_, s| {
                s.send(0, port);
            });
        }
    };
    rounds(&mut sessions, 6);
    let affinities = tally(
        sessions
            .iter()
            .flat_map(|s| s.turns.iter().map(|t| t.affinity())),
    );
    let failed: Vec<String> = sessions
        .iter()
        .filter(|s| s.turns.iter().any(|t| !t.ok()))
        .map(Session::trail)
        .collect();
    eprintln!("uniform phase: affinity {affinities:?}");
    assert!(failed.is_empty(), "failed turns: {failed:?}");
    for m in &large {
        assert_eq!(
            degraded(&m.name),
            0,
            "{} degraded while uniformly slower",
            m.name
        );
    }
    assert!(
        !affinities.contains_key("pin_break"),
        "pins broken in a healthy fleet: {affinities:?}"
    );
    // l3 becomes truly slow among its peers.
    large[2].set_fault(json!({"mode": "slow", "factor": 6}));
    rounds(&mut sessions, 6);
    let states: Vec<(String, i64)> = small
        .iter()
        .chain(&large)
        .map(|m| (m.name.clone(), degraded(&m.name)))
        .collect();
    eprintln!("after l3's slowdown: degraded {states:?}");
    assert_eq!(degraded("l3"), 1, "{states:?}");
    for n in ["s1", "s2", "l1", "l2"] {
        assert_eq!(degraded(n), 0, "{n}: {states:?}");
    }
}
