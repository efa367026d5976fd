//! "Did the pin pay?" through a real Envoy in front of two mock engines: `keeps` (a prefix
//! cache that holds every conversation) and `evicts` (the mock's `--cache-tokens 0`: an engine
//! that forgets a conversation before its next turn).
//!
//! What must hold: per endpoint, `computeflux_pinned_turns_total` counts the affinity hits
//! whose session's previous answer there reported a prompt, and
//! `computeflux_cold_pinned_turns_total` those of them that found less than half of that
//! previous prompt cached — exactly what the answers' own `x-mock-*` token headers, replayed
//! through `payoff::cold_turn`, make them. On `evicts` the cold counter moves with every pinned
//! turn; on `keeps` it does not move while the pinned counter does.

// Test code: failing loudly with context is the point.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::support;

use std::collections::BTreeMap;

use computeflux::scheduler::routing::judge::payoff::cold_turn;
use computeflux::scheduler::wire::usage::Usage;
use serde_json::json;
use support::{chat_body, post_chat, Envoy, EnvoyConfig, MockUpstream, Response};

const MODEL: &str = "m1";
const TURNS: usize = 4;

fn n(r: &Response, h: &str) -> u64 {
    r.header(h).unwrap().parse().unwrap()
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

#[test]
fn cold_pinned_turns_count_where_the_cache_forgot_and_only_there() {
    let fast = ["--prefill-us-per-token", "10", "--decode-ms", "5"];
    let mocks = [
        MockUpstream::start("keeps", &[], &fast),
        MockUpstream::start(
            "evicts",
            &[],
            &[&fast[..], &["--cache-tokens", "0"]].concat(),
        ),
    ];
    let plugin = json!({
        "endpoints": [{"name": "keeps", "cluster": "keeps"}, {"name": "evicts", "cluster": "evicts"}],
        // Self-hosted engines cache from one block: every turn here is judged.
        "tuning": {"payoff_min_prompt_tokens": 16, "payoff_floor": 0},
        "cold_start_samples": 1_000_000,
    });
    let clusters: Vec<(&str, u16)> = mocks.iter().map(|m| (m.name.as_str(), m.port)).collect();
    let envoy = Envoy::start(EnvoyConfig::new(plugin, &clusters));
    let counter = |base: &str, e: &str| {
        envoy
            .stat(&format!("wasmcustom.{base}.endpoint.{e}"))
            .unwrap_or(0)
    };
    let read = |e: &str| {
        (
            counter("computeflux_pinned_turns_total", e),
            counter("computeflux_cold_pinned_turns_total", e),
        )
    };
    assert_eq!((read("keeps"), read("evicts")), ((0, 0), (0, 0)));

    // Expected (pinned, cold) per endpoint, replayed from the answers.
    let mut want: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut homes = BTreeMap::new();
    let mut s = 0;
    // Sessions until both endpoints have served at least two of them.
    while ["keeps", "evicts"]
        .iter()
        .any(|e| homes.values().filter(|h| h == e).count() < 2)
    {
        assert!(
            s < 64,
            "64 sessions never reached both endpoints: {homes:?}"
        );
        let id = format!("paid-{s}");
        s += 1;
        let mut previous: Option<(String, u64)> = None;
        for turn in 1..=TURNS {
            let r = send(envoy.port, &id, turn);
            let at = r.header("x-computeflux-endpoint").unwrap().to_string();
            let hit = r.header("x-computeflux-affinity") == Some("hit");
            assert_eq!(hit, turn > 1, "turn {turn} of {id}");
            let u = Usage {
                prompt_tokens: n(&r, "x-mock-prompt-tokens"),
                cached_tokens: n(&r, "x-mock-cached-tokens"),
                completion_tokens: 0,
            };
            if let Some((before_at, before_prompt)) = &previous {
                assert_eq!(before_at, &at, "a pinned turn stays");
                if let Some(cold) = cold_turn(*before_prompt, &u, 16) {
                    let w = want.entry(at.clone()).or_default();
                    w.0 += 1;
                    w.1 += i64::from(cold);
                }
            }
            previous = Some((at.clone(), u.prompt_tokens));
            homes.insert(id.clone(), at);
        }
    }
    let (keeps, evicts) = (want["keeps"], want["evicts"]);
    // The replay itself says what the rule means: every pinned turn on `evicts` found nothing,
    // every one on `keeps` found its whole previous prompt.
    assert!(
        keeps.0 >= 2 * (TURNS as i64 - 1) && keeps.1 == 0,
        "{keeps:?}"
    );
    assert!(
        evicts.0 >= 2 * (TURNS as i64 - 1) && evicts.1 == evicts.0,
        "{evicts:?}"
    );
    assert_eq!((read("keeps"), read("evicts")), (keeps, evicts));
}
