// Requests without a session over many candidates: their drawn order (`placement::Draws`)
// places them by score as the ranked order did, and never where they are excluded.
use super::*;
use crate::scheduler::health::outcome::FailureKind;
use crate::scheduler::state::store::MemStore;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// 40 endpoints: 0 weighs 8, 1 weighs 4, the others 1; 2 is disabled, 3 serves another
/// model; breakers open at the first failure for good.
fn forty() -> Config {
    let eps: Vec<_> = (0..40)
        .map(|i| {
            let mut ep = json!({"name": format!("e{i}"), "cluster": format!("c{i}")});
            match i {
                0 => ep["weight"] = json!(8.0),
                1 => ep["weight"] = json!(4.0),
                2 => ep["disabled"] = json!(true),
                3 => ep["models"] = json!(["other"]),
                _ => {}
            }
            ep
        })
        .collect();
    Config::from_value(&json!({"endpoints": eps, "failure_threshold": 1, "open_ms": 86_400_000}))
        .unwrap()
}

fn sessionless<'a>(ex: &'a Exclusions, nonce: u64) -> Pick<'a> {
    Pick {
        model: Some("m"),
        session: None,
        attempt: 1,
        exclusions: ex,
        nonce,
        body_bytes: 0,
        pin_hint: None,
        holder: None,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    }
}

/// Where `n` requests without a session (each answered at once) go, by endpoint index.
fn spread(s: &Scheduler<'_>, ex: &Exclusions, n: u64, now: u64) -> Vec<u64> {
    let mut counts = vec![0u64; 40];
    for k in 0..n {
        let nonce = crate::scheduler::state::hash::session_key(b"n", &k.to_le_bytes());
        let d = s.pick(&sessionless(ex, nonce), now).unwrap();
        counts[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Success, 1, None, now);
    }
    counts
}

/// Within five standard deviations of `n × p` (the draws are a fixed function of the
/// nonces: no flakiness, but a wrong law is far outside).
fn near(count: u64, n: u64, p: f64) -> bool {
    let expected = n as f64 * p;
    (count as f64 - expected).abs() <= 5.0 * (expected * (1.0 - p)).sqrt() + 1.0
}

#[test]
fn a_request_without_a_session_follows_weights_scores_and_exclusions_when_drawn() {
    let c = forty();
    let store = MemStore::new();
    let cache = RefCell::new(TableCache::default());
    let s = Scheduler::with_cache(&c, &store, &cache);
    let none = Exclusions::default();
    // Open endpoint 4's breaker: a request placed there fails.
    let mut k = 0u64;
    loop {
        k += 1;
        let d = s.pick(&sessionless(&none, k), 0).unwrap();
        if d.endpoint == 4 {
            let fail = Outcome::EndpointFailure(FailureKind::ConnectFailure);
            s.finish(d.ticket, &fail, 1, None, 0);
            break;
        }
        s.finish(d.ticket, &Outcome::Success, 1, None, 0);
    }
    // Endpoint 5 is a dead key for these requests.
    let ex = Exclusions {
        dead: vec![5],
        ..Exclusions::default()
    };
    let n = 20_000;
    let counts = spread(&s, &ex, n, 10);
    for i in [2, 3, 4, 5] {
        assert_eq!(counts[i], 0, "excluded endpoint {i} was picked");
    }
    // Eligible: 0 (8), 1 (4) and 34 of weight 1.
    let total = 8.0 + 4.0 + 34.0;
    assert!(near(counts[0], n, 8.0 / total), "{counts:?}");
    assert!(near(counts[1], n, 4.0 / total), "{counts:?}");
    for (i, &count) in counts.iter().enumerate().skip(6) {
        assert!(near(count, n, 1.0 / total), "endpoint {i}: {counts:?}");
    }
    // Three requests held at endpoint 1: its score is 4 / (1 + 3) = 1.
    let mut held = Vec::new();
    let mut k = 1_000_000u64;
    while held.len() < 3 {
        k += 1;
        let d = s.pick(&sessionless(&ex, k), 20).unwrap();
        if d.endpoint == 1 {
            held.push(d.ticket);
        } else {
            s.finish(d.ticket, &Outcome::Success, 1, None, 20);
        }
    }
    assert_eq!(s.table().entries[1].1.in_flight, 3);
    let counts = spread(&s, &ex, n, 20);
    let total = 8.0 + 1.0 + 34.0;
    assert!(near(counts[1], n, 1.0 / total), "{counts:?}");
    assert!(near(counts[0], n, 8.0 / total), "{counts:?}");
}

/// With and without the worker's memo (which serves a drawn board and a failover's admission):
/// the same decisions, and a failover's later attempts never go where the request went.
#[test]
fn a_drawn_failover_never_returns_to_the_first_attempt() {
    let c = forty();
    let (plain, cached) = (MemStore::new(), MemStore::new());
    let cache = RefCell::new(TableCache::default());
    let a = Scheduler::new(&c, &plain);
    let b = Scheduler::with_cache(&c, &cached, &cache);
    for k in 0..300u64 {
        let mut ex = Exclusions::default();
        for attempt in 1..=3u32 {
            let pick = Pick {
                attempt,
                ..sessionless(&ex, k)
            };
            let (da, db) = (a.pick(&pick, k).unwrap(), b.pick(&pick, k).unwrap());
            assert_eq!(da, db, "request {k} attempt {attempt}");
            assert!(!ex.tried.contains(&da.endpoint), "request {k} went back");
            let o = Outcome::RateLimited {
                retry_after_ms: None,
            };
            a.finish(da.ticket, &Outcome::Success, 1, None, k);
            b.finish(db.ticket, &Outcome::Success, 1, None, k);
            ex.after_attempt(da.endpoint, &o);
        }
    }
}
