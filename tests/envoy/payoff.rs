//! The affinity payoff (issue 12, item 2) through a real Envoy in front of two mock endpoints,
//! one with a prefix cache (`cache`) and one without (`nocache`, the mock's `--cache-tokens 0`).
//!
//! What must hold: the `computeflux_affinity_payoff_permille` gauge of each endpoint is exactly
//! what the affinity hits' answers (their `x-mock-*` token headers, replayed through
//! `payoff::Payoff`) make it: above zero where the pinned turns found their prefix, zero where
//! they did not. With the closed loop on (`payoff_floor`), once `nocache` has its samples a new
//! session goes where weighted rendezvous puts it with `nocache` weighing `PAYOFF_WEIGHT`
//! (computed here in advance per session): sessions whose home was `nocache` now start on
//! `cache`, those still homed there stay, and pinned sessions keep their pin. With it off, the
//! same sessions start on `nocache`.

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

use computeflux::scheduler::routing::judge::payoff::Payoff;
use computeflux::scheduler::wire::usage::Usage;
use serde_json::json;
use support::placement::{header_session, rendezvous_order};
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream, Response};

const MODEL: &str = "m1";
/// `routing::judge::payoff::PAYOFF_MIN_SAMPLES` and `PAYOFF_WEIGHT`.
const MIN_SAMPLES: u64 = computeflux::scheduler::routing::judge::payoff::PAYOFF_MIN_SAMPLES;
const WEIGHT: f64 = computeflux::scheduler::routing::judge::payoff::PAYOFF_WEIGHT;
const EVEN: [(&str, f64); 2] = [("cache", 1.0), ("nocache", 1.0)];
const REDUCED: [(&str, f64); 2] = [("cache", 1.0), ("nocache", WEIGHT)];

struct Setup {
    _mocks: Vec<MockUpstream>,
    envoy: Envoy,
}

fn setup(floor: f64) -> Setup {
    let fast = ["--prefill-us-per-token", "10", "--decode-ms", "5"];
    let mocks = vec![
        MockUpstream::start("cache", &[], &fast),
        MockUpstream::start(
            "nocache",
            &[],
            &[&fast[..], &["--cache-tokens", "0"]].concat(),
        ),
    ];
    let plugin = json!({
        "endpoints": [{"name": "cache", "cluster": "cache"}, {"name": "nocache", "cluster": "nocache"}],
        "tuning": {"payoff_floor": floor, "payoff_min_prompt_tokens": 1},
        // Placement by static weight (and the payoff factor) alone, whatever the latencies.
        "cold_start_samples": 1_000_000,
    });
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    Setup {
        _mocks: mocks,
        envoy,
    }
}

/// Turn `turn` (1-based) of session `s`: every turn repeats the earlier ones (a conversation),
/// about 100 tokens each.
fn send(port: u16, s: &str, turn: usize) -> Response {
    let msgs: Vec<String> = (1..=turn)
        .map(|t| {
            format!(
                "session {s} turn {t}: {}",
                "a fairly long question text ".repeat(14)
            )
        })
        .collect();
    let refs: Vec<&str> = msgs.iter().map(String::as_str).collect();
    let r = post_chat(
        port,
        &[("x-session-id", s)],
        &chat_body(MODEL, &refs, json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

fn endpoint(r: &Response) -> String {
    r.header("x-computeflux-endpoint").unwrap().to_string()
}

fn affinity(r: &Response) -> String {
    r.header("x-computeflux-affinity").unwrap().to_string()
}

/// Session ids `prefix0, prefix1, ...` whose home is `even` with even weights and `reduced`
/// with `nocache` weighing `WEIGHT`.
fn sessions(prefix: &str, even: &str, reduced: &str, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(|id| {
            let k = header_session(id);
            rendezvous_order(k, &EVEN)[0] == even && rendezvous_order(k, &REDUCED)[0] == reduced
        })
        .take(n)
        .collect()
}

/// The payoff each endpoint's affinity hits make, replayed from the answers' own headers.
#[derive(Default)]
struct Expected(BTreeMap<String, Payoff>);

impl Expected {
    fn record(&mut self, r: &Response) {
        if affinity(r) != "hit" {
            return;
        }
        let n = |h: &str| r.header(h).unwrap().parse::<u64>().unwrap();
        let u = Usage {
            prompt_tokens: n("x-mock-prompt-tokens"),
            cached_tokens: n("x-mock-cached-tokens"),
            completion_tokens: 0,
        };
        self.0.entry(endpoint(r)).or_default().observe(&u, 1);
    }

    fn samples(&self, e: &str) -> u64 {
        self.0.get(e).map_or(0, |p| u64::from(p.samples))
    }

    fn permille(&self, e: &str) -> i64 {
        self.0.get(e).map_or(0, |p| p.permille() as i64)
    }
}

fn gauge(envoy: &Envoy, e: &str) -> Option<i64> {
    envoy.stat(&format!(
        "wasmcustom.computeflux_affinity_payoff_permille.endpoint.{e}"
    ))
}

/// Waits (≤ 5 s: the gauges refresh every second) until both gauges read as expected.
fn settle_gauges(envoy: &Envoy, want: &Expected) -> (Option<i64>, Option<i64>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = (gauge(envoy, "cache"), gauge(envoy, "nocache"));
        let ok = got == (Some(want.permille("cache")), Some(want.permille("nocache")));
        if ok || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Pinned conversations on both endpoints until `nocache` has `MIN_SAMPLES` samples; returns
/// what the gauges should read and one session pinned to `nocache`.
fn warm_up(port: u16, want: &mut Expected) -> String {
    // Sessions homed on `nocache` with even weights and on `cache` with its weight reduced:
    // before the rule has its samples they must still start on `nocache`.
    let warm = sessions("warm-", "nocache", "cache", 3);
    let mut pinned = None;
    for s in &warm {
        for turn in 1..=3 {
            if want.samples("nocache") >= MIN_SAMPLES {
                break;
            }
            let r = send(port, s, turn);
            assert_eq!(endpoint(&r), "nocache", "{s} turn {turn}");
            assert_eq!(affinity(&r), if turn == 1 { "home" } else { "hit" });
            want.record(&r);
            pinned = Some(s.clone());
        }
    }
    assert_eq!(want.samples("nocache"), MIN_SAMPLES);
    for s in sessions("cached-", "cache", "cache", 2) {
        for turn in 1..=3 {
            let r = send(port, &s, turn);
            assert_eq!(endpoint(&r), "cache", "{s} turn {turn}");
            want.record(&r);
        }
    }
    assert_eq!(want.samples("cache"), 4);
    // The last sample is stored as the answer ends; give the write a moment before the next
    // request is placed.
    std::thread::sleep(Duration::from_millis(200));
    pinned.unwrap()
}

#[test]
fn the_gauge_is_the_pinned_turns_cached_share_per_endpoint() {
    let st = setup(0.0);
    let port = st.envoy.port;
    assert_eq!(gauge(&st.envoy, "cache"), Some(0), "no sample yet");
    let mut want = Expected::default();
    warm_up(port, &mut want);
    let got = settle_gauges(&st.envoy, &want);
    println!(
        "payoff gauges: cache {:?}, nocache {:?} (want {} and {})",
        got.0,
        got.1,
        want.permille("cache"),
        want.permille("nocache")
    );
    assert_eq!(
        got,
        (Some(want.permille("cache")), Some(want.permille("nocache")))
    );
    assert!(want.permille("cache") > 300, "the cache paid off");
    assert_eq!(want.permille("nocache"), 0);
    // Prometheus has it per endpoint.
    let prom = st.envoy.prometheus();
    assert!(
        prom.lines()
            .any(|l| l.starts_with("computeflux_affinity_payoff_permille{endpoint=\"cache\"}")),
        "{prom}"
    );
}

/// New sessions after the warm-up: `moved` (homed on `nocache` unless it weighs less) and
/// `kept` (homed on `nocache` either way); returns where each started.
fn place_new(port: u16) -> (Vec<String>, Vec<String>) {
    let first = |s: &String| {
        let r = send(port, s, 1);
        assert_eq!(affinity(&r), "home", "{s}");
        endpoint(&r)
    };
    let moved = sessions("new-", "nocache", "cache", 6)
        .iter()
        .map(first)
        .collect();
    let kept = sessions("new-", "nocache", "nocache", 2)
        .iter()
        .map(first)
        .collect();
    (moved, kept)
}

#[test]
fn with_the_loop_on_new_sessions_leave_an_endpoint_that_caches_nothing() {
    let st = setup(0.1);
    let port = st.envoy.port;
    let mut want = Expected::default();
    let pinned = warm_up(port, &mut want);
    let (moved, kept) = place_new(port);
    assert_eq!(
        moved,
        vec!["cache"; 6],
        "weighed PAYOFF_WEIGHT: placed elsewhere"
    );
    assert_eq!(kept, vec!["nocache"; 2], "a lower weight, not an exclusion");
    // Pins are kept: the pinned session's next turn stays where it was.
    let r = send(port, &pinned, 3);
    assert_eq!(
        (endpoint(&r), affinity(&r)),
        ("nocache".into(), "hit".into())
    );
}

#[test]
fn with_the_loop_off_new_sessions_still_go_to_it() {
    let st = setup(0.0);
    let port = st.envoy.port;
    let mut want = Expected::default();
    warm_up(port, &mut want);
    let (moved, kept) = place_new(port);
    assert_eq!(moved, vec!["nocache"; 6]);
    assert_eq!(kept, vec!["nocache"; 2]);
}
