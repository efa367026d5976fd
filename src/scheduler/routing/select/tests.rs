// The selection's unit tests (over 600 lines: one scenario per rule of choose and finish).
use super::*;
use crate::scheduler::health::outcome::FailureKind;
use crate::scheduler::routing::judge::saturation::Saturation;
use crate::scheduler::routing::judge::slowness::{Sample, WorkModel};
use crate::scheduler::routing::select::signals::Served;
use crate::scheduler::state::store::MemStore;
use serde_json::json;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn cfg(v: serde_json::Value) -> Config {
    Config::from_value(&v).unwrap()
}

fn four() -> Config {
    cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},
        {"name":"c","cluster":"cc","models":["other"]},{"name":"d","cluster":"cd","disabled":true}
    ]}))
}

fn pick_at(
    s: &Scheduler<'_>,
    session: Option<u64>,
    ex: &Exclusions,
    now: u64,
) -> Result<Decision, NoEndpoint> {
    s.pick(
        &Pick {
            model: Some("m"),
            session,
            attempt: 1,
            exclusions: ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        },
        now,
    )
}

#[test]
fn exclusions_in_order_and_model_not_found() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions {
        dead: vec![0],
        used: vec![0, 1],
        tried: vec![],
        retry_free: false,
        placeless: vec![],
    };
    let (cands, dropped) = s
        .candidates(&Pick {
            model: Some("m"),
            session: None,
            attempt: 1,
            exclusions: &Exclusions::default(),
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        })
        .unwrap();
    assert_eq!(cands, vec![0, 1]);
    assert_eq!(
        dropped,
        Dropped {
            disabled: 1,
            model: 1,
            ..Default::default()
        }
    );
    // a is dead (counted as dead, not used), b used: nothing left, but the model exists.
    let err = s
        .candidates(&Pick {
            model: Some("m"),
            session: None,
            attempt: 1,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        })
        .unwrap_err();
    assert_eq!(err, NoEndpoint::Exhausted);
    assert_eq!(
        pick_at(&s, None, &Exclusions::default(), 0).map(|_| ()),
        Ok(())
    );
    // Only a disabled endpoint serves "dmodel": not found either.
    let c2 = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca","models":["m"]},{"name":"d","cluster":"cd","models":["dm"],"disabled":true}]}),
    );
    let s2 = Scheduler::new(&c2, &store);
    assert_eq!(
        s2.pick(
            &Pick {
                model: Some("dm"),
                session: None,
                attempt: 1,
                exclusions: &Exclusions::default(),
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            0
        )
        .unwrap_err(),
        NoEndpoint::ModelNotFound
    );
}

#[test]
fn affinity_sticks_and_repins_after_failover() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let d1 = pick_at(&s, Some(77), &ex, 0).unwrap();
    assert_eq!(d1.affinity, AffinityResult::Home);
    s.finish(d1.ticket, &Outcome::Success, 100, Some(77), 10);
    for t in 0..10 {
        let d = pick_at(&s, Some(77), &ex, 20 + t).unwrap();
        assert_eq!(
            (d.endpoint, d.reason, d.affinity),
            (d1.endpoint, Reason::AffinityHit, AffinityResult::Hit)
        );
        s.finish(d.ticket, &Outcome::Success, 100, Some(77), 20 + t);
    }
    // The pinned endpoint rate-limits: this request fails over; the pin moves on success.
    let first = pick_at(&s, Some(77), &ex, 100).unwrap();
    let rl = Outcome::RateLimited {
        retry_after_ms: Some(5_000),
    };
    s.finish(first.ticket, &rl, 5, Some(77), 101);
    let mut ex2 = Exclusions::default();
    ex2.after_attempt(first.endpoint, &rl);
    let second = s
        .pick(
            &Pick {
                model: Some("m"),
                session: Some(77),
                attempt: 2,
                exclusions: &ex2,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            102,
        )
        .unwrap();
    assert_ne!(second.endpoint, first.endpoint);
    assert_eq!(second.affinity, AffinityResult::Miss);
    s.finish(second.ticket, &Outcome::Success, 50, Some(77), 150);
    let after = pick_at(&s, Some(77), &ex, 200).unwrap();
    assert_eq!(
        (after.endpoint, after.affinity),
        (second.endpoint, AffinityResult::Hit)
    );
    // TTL: idle past 5 minutes, the pin is gone.
    s.finish(after.ticket, &Outcome::Cancelled, 0, Some(77), 200);
    assert_eq!(
        pick_at(&s, Some(77), &ex, 150 + 300_000).unwrap().affinity,
        AffinityResult::Home
    );
}

#[test]
fn dead_key_evicts_the_pin() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let d = pick_at(&s, Some(5), &Exclusions::default(), 0).unwrap();
    s.finish(d.ticket, &Outcome::Success, 10, Some(5), 1);
    let d = pick_at(&s, Some(5), &Exclusions::default(), 2).unwrap();
    assert_eq!(d.affinity, AffinityResult::Hit);
    s.finish(d.ticket, &Outcome::DeadKey, 10, Some(5), 3);
    assert_eq!(s.affinity().lookup(5, 4), None);
}

/// Session keys as the filter derives them.
fn key(i: u64) -> u64 {
    crate::scheduler::state::hash::session_key(b"", &i.to_le_bytes())
}

#[test]
fn cold_start_places_by_weight_alone_for_exactly_twenty_requests() {
    let c = cfg(
        json!({"endpoints":[{"name":"bad","cluster":"c1","weight":3},{"name":"good","cluster":"c2","weight":1}]}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    // While cold, new sessions split 3:1 by weight, whatever the endpoint does.
    let mut to_bad = 0;
    for n in 0..20u64 {
        let d = pick_at(&s, Some(key(n)), &ex, n * 10).unwrap();
        assert_eq!(d.affinity, AffinityResult::Home);
        if d.endpoint == 0 {
            to_bad += 1;
            // 401s: never trip the breaker, only the statistics.
            s.finish(d.ticket, &Outcome::DeadKey, 5, None, n * 10 + 1);
        } else {
            s.finish(d.ticket, &Outcome::Cancelled, 5, None, n * 10 + 1);
        }
    }
    assert!(to_bad > 10, "{to_bad} of 20 to the weight-3 endpoint");
    let mut shares = [0u32; 2];
    for n in 100..4100u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 300).unwrap();
        shares[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 300);
    }
    // Still cold (fewer than 20 samples): 3:1 by weight, 401s or not.
    assert!(s.table().entries[0].1.total < 20);
    let share = f64::from(shares[0]) / 4000.0;
    assert!((share - 0.75).abs() < 0.03, "{shares:?}");
    // Warm it up to exactly 20 samples of failure.
    let mut n = 10_000;
    while s.table().entries[0].1.total < 20 {
        let d = pick_at(&s, Some(key(n)), &ex, 400).unwrap();
        let o = if d.endpoint == 0 {
            Outcome::DeadKey
        } else {
            Outcome::Cancelled
        };
        s.finish(d.ticket, &o, 5, None, 401);
        n += 1;
    }
    let st = s.table().entries[0].1;
    assert_eq!(st.total, 20);
    let w = crate::scheduler::routing::placement::weigh(3.0, &st, &c, 402);
    assert!(w < 0.1, "failing endpoint still weighs {w:?}");
    let mut to_bad = 0;
    for n in 20_000..21_000u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 402).unwrap();
        to_bad += u32::from(d.endpoint == 0);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 402);
    }
    assert!(
        to_bad < 50,
        "{to_bad} of 1000 new sessions still to the failing endpoint"
    );
}

#[test]
fn slow_endpoint_loses_new_sessions_after_warm_up() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],"cold_start_samples":5}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    seed_model(&store);
    let mut now = 0;
    // The same work everywhere: b takes 5x as long for it.
    for i in 0..200u64 {
        let d = pick_at(&s, Some(i), &ex, now).unwrap();
        let latency = if d.endpoint == 1 { 500 } else { 100 };
        now += 1;
        finish_streamed(&s, d.ticket, latency, None, now);
    }
    let mut to_b = 0;
    for i in 1000..1100u64 {
        let d = pick_at(&s, Some(i), &ex, now).unwrap();
        to_b += usize::from(d.endpoint == 1);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
    }
    assert_eq!(to_b, 0);
}

#[test]
fn new_sessions_spread_over_equal_endpoints_by_rendezvous() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}]}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let mut counts = [0usize; 3];
    for i in 0..3000u64 {
        let d = pick_at(
            &s,
            Some(crate::scheduler::state::hash::session_key(
                b"",
                &i.to_le_bytes(),
            )),
            &Exclusions::default(),
            0,
        )
        .unwrap();
        counts[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
        // A second process with the same view agrees.
        let other = MemStore::new();
        let s2 = Scheduler::new(&c, &other);
        let d2 = pick_at(
            &s2,
            Some(crate::scheduler::state::hash::session_key(
                b"",
                &i.to_le_bytes(),
            )),
            &Exclusions::default(),
            0,
        )
        .unwrap();
        assert_eq!(d.endpoint, d2.endpoint);
    }
    for n in counts {
        assert!((800..1200).contains(&n), "{counts:?}");
    }
}

#[test]
fn breaker_lifecycle_through_the_scheduler() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb","weight":0.5}],
        "open_ms":1000,"failure_threshold":2,"half_open_probes":3}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    // Sessions whose home is a.
    let homed_at_a: Vec<u64> = (0..200)
        .map(key)
        .filter(|&k| {
            let other = MemStore::new();
            pick_at(&Scheduler::new(&c, &other), Some(k), &ex, 0)
                .unwrap()
                .endpoint
                == 0
        })
        .take(12)
        .collect();
    assert_eq!(homed_at_a.len(), 12);
    let fail = Outcome::EndpointFailure(FailureKind::ConnectFailure);
    for (t, &k) in homed_at_a[..2].iter().enumerate() {
        let d = pick_at(&s, Some(k), &ex, t as u64).unwrap();
        assert_eq!((d.endpoint, d.reason), (0, Reason::Home));
        s.finish(d.ticket, &fail, 1, None, t as u64);
    }
    // a is open: its sessions go to their backup, b.
    let d = pick_at(&s, Some(homed_at_a[2]), &ex, 10).unwrap();
    assert_eq!(
        (d.endpoint, d.reason, d.affinity),
        (1, Reason::Backup, AffinityResult::Backup)
    );
    s.finish(d.ticket, &Outcome::Success, 1, None, 10);
    // Cooldown over: exactly three probes go to a, then its sessions go to b.
    let picks: Vec<Decision> = homed_at_a[3..9]
        .iter()
        .map(|&k| pick_at(&s, Some(k), &ex, 1001).unwrap())
        .collect();
    let probes: Vec<&Decision> = picks.iter().filter(|d| d.endpoint == 0).collect();
    assert_eq!(probes.len(), 3);
    assert!(probes
        .iter()
        .all(|d| d.reason == Reason::HalfOpenProbe && d.ticket.probe_epoch.is_some()));
    for d in picks {
        s.finish(d.ticket, &Outcome::Success, 1, None, 1002);
    }
    assert_eq!(s.table().entries[0].1.breaker.state, BreakerState::Closed);
    assert_eq!(s.table().entries[0].1.in_flight, 0);
    assert_eq!(
        pick_at(&s, Some(homed_at_a[9]), &ex, 1003)
            .unwrap()
            .endpoint,
        0
    );
}

#[test]
fn all_cooling_down_reports_earliest_recovery_and_rate_limit() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let d = pick_at(&s, None, &ex, 0).unwrap();
    s.finish(
        d.ticket,
        &Outcome::RateLimited {
            retry_after_ms: Some(7_000),
        },
        1,
        None,
        0,
    );
    let d = pick_at(&s, None, &ex, 0).unwrap();
    s.finish(
        d.ticket,
        &Outcome::RateLimited {
            retry_after_ms: Some(3_000),
        },
        1,
        None,
        0,
    );
    assert_eq!(
        pick_at(&s, None, &ex, 1).unwrap_err(),
        NoEndpoint::CoolingDown {
            retry_at_ms: 3_000,
            all_rate_limited: true
        }
    );
}

#[test]
fn retry_budget_limits_failovers() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],
        "retry_budget_percent":10,"tuning":{"retry_budget_min_retries":2}}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    for _ in 0..10 {
        let d = pick_at(&s, None, &ex, 0).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
    }
    let retry = |_| {
        s.pick(
            &Pick {
                model: Some("m"),
                session: None,
                attempt: 2,
                exclusions: &ex,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            0,
        )
    };
    let results: Vec<bool> = (0..5).map(retry).map(|r| r.is_ok()).collect();
    assert_eq!(results, vec![true, true, true, false, false]); // 2 + 10% of 10
}

#[test]
fn failovers_after_401_or_429_spend_no_retry_budget() {
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],
        "retry_budget_percent":0,"tuning":{"retry_budget_min_retries":0}}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let failover = |outcome: Outcome| {
        let mut ex = Exclusions::default();
        ex.after_attempt(0, &outcome);
        let pick = Pick {
            model: Some("m"),
            session: None,
            attempt: 2,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 0,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        };
        s.pick(&pick, 0)
            .map(|d| s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0))
    };
    // No budget at all: a 5xx failover is refused, 401/403/429 failovers go through.
    assert_eq!(
        failover(Outcome::EndpointFailure(FailureKind::Status(503))).unwrap_err(),
        NoEndpoint::BudgetExhausted
    );
    assert!(failover(Outcome::DeadKey).is_ok());
    assert!(failover(Outcome::RateLimited {
        retry_after_ms: None
    })
    .is_ok());
}

#[test]
fn dead_keys_sink_fast() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"}],"cold_start_samples":0}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    for _ in 0..2 {
        let d = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
        s.finish(d.ticket, &Outcome::DeadKey, 1, None, 0);
    }
    // Two 401s at alpha 0.5: 1 → 0.5 → 0.25 (at the default alpha 0.1 it would be 0.81).
    assert!((s.table().entries[0].1.success_rate - 0.25).abs() < 1e-12);
}

#[test]
fn cas_conflicts_are_retried_and_exhaustion_is_reported() {
    let c = four();
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    store.inject_conflicts.set(3);
    let d = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
    assert!(d.ticket.counted);
    store.inject_conflicts.set(100);
    let d2 = pick_at(&s, None, &Exclusions::default(), 0).unwrap();
    assert!(!d2.ticket.counted);
    store.inject_conflicts.set(0);
    s.finish(d2.ticket, &Outcome::Success, 1, None, 1);
    s.finish(d.ticket, &Outcome::Success, 1, None, 1);
    assert_eq!(s.table().entries[d.endpoint].1.in_flight, 0);
}

/// The work model's key of the tests' requests (model "m", listed by no endpoint).
const WORK: &str = "computeflux/work/*";

/// Stores a warm work model that expects the prior's costs: 50 ms + 0.2 ms per uncached
/// token (a streamed answer of 1000 uncached tokens: 250 ms).
fn seed_model(store: &dyn Store) {
    let mut m = WorkModel::default();
    for i in 0..64u64 {
        let prompt = 500 + (i * 97) % 3000;
        m.observe(&Sample {
            streamed: true,
            observed_ms: 50.0 + 0.2 * prompt as f64,
            prompt_tokens: prompt,
            cached_tokens: 0,
            completion_tokens: 0,
            estimated: false,
            decode_ms: None,
        });
    }
    store.set(WORK, &m.encode(), None).unwrap();
}

/// A streamed answer of 1000 uncached prompt tokens that took `ms` to its first byte (the
/// seeded model expects 250 ms: slowness `ms / 250`).
fn streamed(ms: u64) -> Served {
    Served {
        streamed: true,
        decode_ms: None,
        decode_bytes: None,
        observed_ms: ms,
        usage: Some(Usage {
            prompt_tokens: 1000,
            cached_tokens: 0,
            completion_tokens: 20,
        }),
        body_bytes: 4000,
        relayed_bytes: 100,
        work_key: WORK.into(),
    }
}

/// Finishes `ticket` as a success whose answer was a stream timed `ms` to its first byte.
fn finish_streamed(s: &Scheduler<'_>, mut ticket: Ticket, ms: u64, session: Option<u64>, now: u64) {
    ticket.served = Some(streamed(ms));
    s.finish(ticket, &Outcome::Success, ms, session, now);
}

/// Warms every endpoint of `s` with `samples` successes at the given latencies (by index),
/// each a streamed answer of the same work (see [`streamed`]), over a seeded work model.
fn warm(s: &Scheduler<'_>, latencies: &[u64], samples: u64, now: u64) {
    let c = s.cfg;
    if s.store.get(WORK).0.is_none() {
        seed_model(s.store);
    }
    for (i, &lat) in latencies.iter().enumerate() {
        for _ in 0..samples {
            let ticket = Ticket {
                endpoint: i,
                endpoint_id: c.endpoints[i].id,
                probe_epoch: None,
                counted: false,
                started_ms: now,
                degraded_probe: false,
                pin_on_success: false,
                pinned_usage: None,
                served: None,
                quota_tokens: 0,
                quota_mark: Default::default(),
                placement_key: 0,
                previous_prompt_tokens: 0,
            };
            finish_streamed(s, ticket, lat, None, now);
        }
    }
}

fn five() -> Config {
    cfg(json!({"endpoints":[
        {"name":"e0","cluster":"c0"},{"name":"e1","cluster":"c1"},{"name":"e2","cluster":"c2"},
        {"name":"e3","cluster":"c3","weight":2},{"name":"e4","cluster":"c4"}
    ],"cold_start_samples":5}))
}

#[test]
fn replicas_with_similar_statistics_place_every_session_alike() {
    let c = five();
    // Two Envoys that measured somewhat different latencies (all within 2x of each other).
    let (a, b) = (MemStore::new(), MemStore::new());
    let (sa, sb) = (Scheduler::new(&c, &a), Scheduler::new(&c, &b));
    warm(&sa, &[100, 120, 110, 130, 105], 10, 0);
    warm(&sb, &[125, 100, 140, 105, 118], 10, 0);
    // A third that just restarted: empty shared data, everything cold.
    let fresh = MemStore::new();
    let sf = Scheduler::new(&c, &fresh);
    let ex = Exclusions::default();
    let mut homes = [0u32; 5];
    for n in 0..2000u64 {
        let da = pick_at(&sa, Some(key(n)), &ex, 1).unwrap();
        let db = pick_at(&sb, Some(key(n)), &ex, 1).unwrap();
        let df = pick_at(&sf, Some(key(n)), &ex, 1).unwrap();
        assert_eq!((da.endpoint, da.reason), (db.endpoint, Reason::Home), "{n}");
        assert_eq!(da.endpoint, df.endpoint, "{n}");
        homes[da.endpoint] += 1;
        for (s, d) in [(&sa, da), (&sb, db), (&sf, df)] {
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1);
        }
    }
    // Shares follow weights (1,1,1,2,1 of 6).
    for (i, &h) in homes.iter().enumerate() {
        let expected = if i == 3 { 2.0 / 6.0 } else { 1.0 / 6.0 };
        let share = f64::from(h) / 2000.0;
        assert!((share - expected).abs() < 0.035, "{homes:?}");
    }
}

#[test]
fn failover_walks_the_rendezvous_order_on_every_replica() {
    let c = five();
    let ex0 = Exclusions::default();
    for n in 0..200u64 {
        let k = key(n);
        let mut seen: Vec<Vec<usize>> = Vec::new();
        for _replica in 0..2 {
            let store = MemStore::new();
            let s = Scheduler::new(&c, &store);
            let mut ex = ex0.clone();
            let mut order = Vec::new();
            for attempt in 1..=5u32 {
                let d = s
                    .pick(
                        &Pick {
                            model: Some("m"),
                            session: Some(k),
                            attempt,
                            exclusions: &ex,
                            nonce: attempt.into(),
                            body_bytes: 0,
                            pin_hint: None,
                            holder: None,
                            prefix: Prefix::NONE,
                            follow_up: false,
                            max_output_tokens: 0,
                        },
                        0,
                    )
                    .unwrap();
                let expected = if attempt == 1 {
                    Reason::Home
                } else {
                    Reason::Backup
                };
                assert_eq!(d.reason, expected);
                let rl = Outcome::RateLimited {
                    retry_after_ms: None,
                };
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
                ex.after_attempt(d.endpoint, &rl);
                order.push(d.endpoint);
            }
            seen.push(order);
        }
        assert_eq!(seen[0], seen[1]);
        let weights: Vec<(usize, u32, f64)> = c
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| (i, e.id, e.weight))
            .collect();
        assert_eq!(
            seen[0],
            crate::scheduler::routing::placement::order(k, &weights)
        );
    }
}

#[test]
fn bounded_load_spills_in_rendezvous_order() {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"},{"name":"d","cluster":"cd"}
    ],"tuning":{"bounded_load_epsilon":0.25,"bounded_load_slack":1}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    // Keep every attempt in flight; sessions with the same home pile up until they spill.
    let mut in_flight = Vec::new();
    let mut spills = 0;
    for n in 0..400u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 0).unwrap();
        let table = s.table();
        let total: u32 = table.entries.iter().map(|(_, st)| st.in_flight).sum();
        let mine = table.entries[d.endpoint].1.in_flight;
        // The bound (1 + eps) x L x 1/4 + slack, with L counting this attempt.
        let limit = 1.25 * f64::from(total) / 4.0 + 1.0;
        assert!(f64::from(mine) <= limit + 1e-9, "{mine} > {limit}");
        if d.reason == Reason::Spill {
            assert_eq!(d.affinity, AffinityResult::Spill);
            spills += 1;
        }
        in_flight.push(d);
    }
    assert!(spills > 0);
    for d in in_flight {
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1);
    }
    // Once load is even again, nothing spills.
    let d = pick_at(&s, Some(key(1)), &ex, 2).unwrap();
    assert_eq!(d.reason, Reason::Home);
}

/// A session pinned to `home`'s backup by a failover: returns the endpoint of the next turn
/// once the home admits traffic again.
fn after_failover_next_turn() -> (usize, usize, usize) {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}
    ]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = key(42);
    let home = pick_at(&s, Some(k), &ex, 0).unwrap();
    s.finish(home.ticket, &Outcome::Success, 10, Some(k), 1);
    let first = pick_at(&s, Some(k), &ex, 2).unwrap();
    assert_eq!(first.reason, Reason::AffinityHit);
    let rl = Outcome::RateLimited {
        retry_after_ms: Some(1_000),
    };
    s.finish(first.ticket, &rl, 10, Some(k), 3);
    let mut ex2 = Exclusions::default();
    ex2.after_attempt(first.endpoint, &rl);
    let backup = s
        .pick(
            &Pick {
                model: Some("m"),
                session: Some(k),
                attempt: 2,
                exclusions: &ex2,
                nonce: 0,
                body_bytes: 0,
                pin_hint: None,
                holder: None,
                prefix: Prefix::NONE,
                follow_up: false,
                max_output_tokens: 0,
            },
            4,
        )
        .unwrap();
    s.finish(backup.ticket, &Outcome::Success, 10, Some(k), 5);
    // During the window: the backup either way.
    let during = pick_at(&s, Some(k), &ex, 500).unwrap();
    assert_eq!(during.endpoint, backup.endpoint);
    s.finish(during.ticket, &Outcome::Success, 10, Some(k), 501);
    // After the window (the half-open home admits a probe).
    let after = pick_at(&s, Some(k), &ex, 2_000).unwrap();
    s.finish(after.ticket, &Outcome::Cancelled, 0, None, 2_001);
    (home.endpoint, backup.endpoint, after.endpoint)
}

/// After a failover the session stays on the backup that served it (its newest prefix is
/// cached there), also once its home admits traffic again.
#[test]
fn after_a_failover_the_session_stays_on_the_backup() {
    let (home, backup, after) = after_failover_next_turn();
    assert_ne!(home, backup);
    assert_eq!(after, backup);
}

#[test]
fn a_degraded_pin_breaks_with_hysteresis_and_gets_probes() {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}
    ],"cold_start_samples":5,"tuning":{"degraded_probe_interval_ms":1000}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 5, 0);
    // Pin sessions to a.
    let on_a: Vec<u64> = (0..300)
        .map(key)
        .filter(|&k| {
            let d = pick_at(&s, Some(k), &ex, 1).unwrap();
            s.finish(d.ticket, &Outcome::Success, 100, Some(k), 1);
            d.endpoint == 0
        })
        .collect();
    assert!(on_a.len() > 50);
    // a turns 2.5x slower: below pin_break_ratio (3), pins hold.
    warm(&s, &[250, 100, 100], 20, 2);
    let d = pick_at(&s, Some(on_a[0]), &ex, 3).unwrap();
    assert_eq!(d.reason, Reason::AffinityHit);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 3);
    // 5x slower: pins break, to the next endpoint in each session's order.
    warm(&s, &[500, 100, 100], 20, 4);
    for &k in &on_a[..20] {
        let d = pick_at(&s, Some(k), &ex, 5).unwrap();
        assert_eq!(
            (d.reason, d.affinity, d.broke_pin_of),
            (Reason::PinBreak, AffinityResult::PinBreak, Some(0))
        );
        assert_ne!(d.endpoint, 0);
        s.finish(d.ticket, &Outcome::Success, 100, Some(k), 6);
        // Re-pinned where it went.
        let again = pick_at(&s, Some(k), &ex, 7).unwrap();
        assert_eq!(
            (again.endpoint, again.reason),
            (d.endpoint, Reason::AffinityHit)
        );
        s.finish(again.ticket, &Outcome::Cancelled, 0, None, 7);
    }
    assert!(s.table().entries[0].1.degraded);
    // New sessions avoid a, but one probe per interval.
    let mut to_a = Vec::new();
    for n in 1000..1400u64 {
        let now = 10 + (n - 1000) * 10; // 4 s
        let d = pick_at(&s, Some(key(n)), &ex, now).unwrap();
        if d.endpoint == 0 {
            assert_eq!(d.reason, Reason::DegradedProbe);
            assert!(!d.ticket.pin_on_success);
            to_a.push(now);
        }
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
    }
    // Probes that never come back fast: the interval doubles (1 s, 2 s, ...).
    assert!((2..=3).contains(&to_a.len()), "probes at {to_a:?}");
    assert!(to_a[0] >= 1_000, "{to_a:?}");
    assert!(
        to_a.windows(2)
            .enumerate()
            .all(|(i, w)| w[1] - w[0] >= 1000 << (i + 1)),
        "{to_a:?}"
    );
    // Recovering to 2x: still degraded (exit below 1.5x): hysteresis.
    warm(&s, &[200, 100, 100], 30, 5_000);
    let d = pick_at(&s, Some(on_a[30]), &ex, 5_001).unwrap();
    assert_eq!(d.reason, Reason::PinBreak);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 5_001);
    // Back to 1x: whole again; pins to it hold and new sessions reach it.
    warm(&s, &[100, 100, 100], 30, 6_000);
    let d = pick_at(&s, Some(on_a[31]), &ex, 6_001).unwrap();
    assert_eq!(d.reason, Reason::AffinityHit);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 6_001);
    assert!(!s.table().entries[0].1.degraded);
}

#[test]
fn cold_endpoints_never_break_pins() {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}
    ],"cold_start_samples":50}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[1000, 10], 20, 0); // 100x slower, but cold
    for n in 0..50u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 1).unwrap();
        s.finish(d.ticket, &Outcome::Success, 1, Some(key(n)), 1);
        let again = pick_at(&s, Some(key(n)), &ex, 2).unwrap();
        assert_eq!(again.reason, Reason::AffinityHit);
        s.finish(again.ticket, &Outcome::Cancelled, 0, None, 2);
    }
}

/// Sessions of `s` pinned to endpoint 0 (of the first `n` keys).
fn pinned_to_first(s: &Scheduler<'_>, ex: &Exclusions, n: u64, now: u64) -> Vec<u64> {
    (0..n)
        .map(key)
        .filter(|&k| {
            let d = pick_at(s, Some(k), ex, now).unwrap();
            let first = d.endpoint == 0;
            s.finish(d.ticket, &Outcome::Success, 100, Some(k), now);
            first
        })
        .collect()
}

fn three_warm(extra: serde_json::Value) -> Config {
    let mut v = json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}
    ],"cold_start_samples":5});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    cfg(v)
}

/// Runs `f` on a fleet of three endpoints (`extra` configuration keys) warm at 100 ms, with
/// the sessions among the first 200 keys pinned to endpoint 0.
fn with_pins_on_first(
    extra: serde_json::Value,
    f: impl FnOnce(&Scheduler<'_>, &Exclusions, &[u64]),
) {
    let c = three_warm(extra);
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 10, 0);
    let on_a = pinned_to_first(&s, &ex, 200, 1);
    assert!(on_a.len() > 20);
    f(&s, &ex, &on_a);
}

/// Only answers make an endpoint degraded: pinned turns held long without an answer (a long
/// generation on a healthy endpoint looks the same) break no pin.
#[test]
fn pinned_turns_held_without_an_answer_break_no_pin() {
    with_pins_on_first(json!({}), |s, ex, on_a| {
        let held: Vec<Decision> = (0..5)
            .map(|j| pick_at(s, Some(on_a[j]), ex, 1_000).unwrap())
            .collect();
        let d = pick_at(s, Some(on_a[10]), ex, 5_000).unwrap();
        assert_eq!(d.reason, Reason::AffinityHit);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 5_000);
        for h in held {
            s.finish(h.ticket, &Outcome::Cancelled, 0, None, 5_000);
        }
    });
}

#[test]
fn a_streamed_hit_running_for_a_minute_is_no_evidence() {
    with_pins_on_first(json!({}), |s, ex, on_a| {
        let streaming = pick_at(s, Some(on_a[0]), ex, 1_000).unwrap();
        // Its stream goes on for a minute: no evidence against a.
        let d = pick_at(s, Some(on_a[1]), ex, 61_000).unwrap();
        assert_eq!(d.reason, Reason::AffinityHit);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 61_000);
        s.finish(
            streaming.ticket,
            &Outcome::Success,
            90,
            Some(on_a[0]),
            61_000,
        );
    });
}

/// Three replicas probing a degraded endpoint whose engine publishes its pace send no more
/// probes than one (on their own timers: three times as many; doubling their intervals after
/// their own probes only: about one per base interval and probe length): the interval runs
/// from the engine's last decoding (another replica's probe shows there), it doubles with the
/// probes that decoding counts (`placement::fleet_probes`), and no probe goes while the
/// engine's scrape shows one running. One replica's probes come as its own backoff says. `a`
/// decodes 5× slower than `b` and `c` (by the engines' pace, every replica's verdict); a probe
/// runs 1.5 s there. New sessions every 100 ms, round robin over the replicas; every replica
/// scrapes every engine every 100 ms.
#[test]
fn replicas_probe_a_scraped_degraded_engine_in_turn() {
    use crate::scheduler::wire::engine_load::{DecodeTotals, Engine, EngineLoad as Wire};
    let c = three_warm(json!({"tuning": {"degraded_probe_interval_ms": 1000}}));
    let keep: Vec<u32> = c.endpoints.iter().map(|e| e.id).collect();
    let probes = |replicas: usize| -> Vec<u64> {
        let stores: Vec<MemStore> = (0..replicas).map(|_| MemStore::new()).collect();
        let ss: Vec<Scheduler<'_>> = stores.iter().map(|st| Scheduler::new(&c, st)).collect();
        let ex = Exclusions::default();
        // The engines' decode counters: (µs, tokens) of a, b, c.
        let mut decoded = [(0u64, 0u64); 3];
        let mut busy_until = 1_000u64; // a decodes its own sessions' answers until 1 s
        let mut probes = Vec::new();
        // A probe's ticket and its replica, answered when `a` is done with it.
        let mut probing: Option<(usize, Ticket)> = None;
        for step in 0..300u64 {
            let now = 100 * step;
            if now >= busy_until {
                if let Some((r, t)) = probing.take() {
                    ss[r].finish(t, &Outcome::Cancelled, 0, None, now);
                }
            }
            for (e, d) in decoded.iter_mut().enumerate() {
                let (per_token_us, tokens) = match e {
                    0 if now < busy_until => (50_000, 20),
                    0 => (50_000, 0),
                    _ => (10_000, 100),
                };
                *d = (d.0 + per_token_us * tokens, d.1 + tokens);
            }
            for store in &stores {
                for (e, d) in decoded.iter().enumerate() {
                    let running = u32::from(e != 0 || now < busy_until);
                    let load = Wire {
                        engine: Engine::Vllm,
                        waiting: Some(0),
                        running: Some(running),
                        kv_usage_permille: Some(100),
                        prompt_tokens_total: None,
                        prompt_tokens_cached_total: None,
                        decode: Some(DecodeTotals {
                            seconds_us: d.0,
                            count: d.1,
                        }),
                    };
                    crate::scheduler::routing::scrape::fold(store, keep[e], now, Ok(load), &keep)
                        .unwrap();
                }
            }
            let r = step as usize % replicas;
            let d = pick_at(&ss[r], Some(key(60_000 + step)), &ex, now + 50).unwrap();
            if d.reason == Reason::DegradedProbe {
                probes.push(now + 50);
                busy_until = now + 1_550;
                probing = Some((r, d.ticket));
            } else {
                ss[r].finish(d.ticket, &Outcome::Cancelled, 0, None, now + 50);
            }
        }
        probes
    };
    let (one, three) = (probes(1), probes(3));
    assert!(one.len() >= 3, "one replica probed {one:?}");
    assert!(
        three.len() <= one.len(),
        "three replicas probed {} times ({three:?}), one {} ({one:?})",
        three.len(),
        one.len()
    );
    // One replica: its k-th probe after the previous one's 1.55 s and its own k-th interval
    // (2, 4, 8 … s), within the engine's last pace window (closed every 200 ms here) and the
    // 100 ms steps; the fleet's count delays none of them.
    for (k, w) in one.windows(2).enumerate() {
        let own = 1_550 + placement::probe_interval(&c, k as u8 + 1);
        assert!(w[1] - w[0] <= own + 400, "probe {} late: {one:?}", k + 2);
    }
    // Never two at once: each probe went to an idle engine.
    assert!(three.windows(2).all(|w| w[1] - w[0] >= 1_500), "{three:?}");
}

/// A probe is a first turn: a later turn without a pin at this replica (with several
/// replicas, two turns in three) has its history cached where its session lives, and as a
/// probe it would pay a full prefill on the slow endpoint (the bench's `slow` run with three
/// replicas: follow-up turns probed onto the 5× endpoint took 3.9–4.5 s, cached 0).
#[test]
fn a_follow_up_without_a_pin_here_is_never_a_probe() {
    let c = three_warm(json!({"tuning": {"degraded_probe_interval_ms": 1000}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 5, 0);
    warm(&s, &[600, 100, 100], 20, 1);
    let turn = |k: u64, follow_up: bool, now: u64| {
        let p = Pick {
            follow_up,
            ..body_pick(Some(k), &ex, 400)
        };
        let d = s.pick(&p, now).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
        (d.endpoint, d.reason)
    };
    // Later turns of 400 sessions over 20 s, probes due every second: none reaches a.
    for n in 0..400u64 {
        let (endpoint, reason) = turn(key(20_000 + n), true, 2 + n * 50);
        assert_ne!(
            endpoint, 0,
            "a follow-up went to the degraded endpoint as {reason:?}"
        );
    }
    // First turns still probe it.
    let probed = (0..400u64)
        .filter(|n| turn(key(30_000 + n), false, 30_000 + n * 50) == (0, Reason::DegradedProbe))
        .count();
    assert!(probed >= 1);
}

#[test]
fn a_fast_probe_answer_resets_the_probe_backoff() {
    let c = three_warm(json!({"tuning": {"degraded_probe_interval_ms": 1000}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 5, 0);
    warm(&s, &[600, 100, 100], 20, 1);
    // The degradation is stored by the next pick; then probes come after 1 s, 2 s, 4 s ...
    let mut n = 10_000u64;
    let mut probes = Vec::new();
    let mut now = 2;
    while now < 30_000 && probes.len() < 3 {
        let d = pick_at(&s, Some(key(n)), &ex, now).unwrap();
        n += 1;
        if d.reason == Reason::DegradedProbe {
            probes.push(now);
            // Still slow.
            finish_streamed(&s, d.ticket, 600, None, now + 600);
        } else {
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
        }
        now += 50;
    }
    assert_eq!(probes.len(), 3, "{probes:?}");
    assert!(
        probes[1] - probes[0] >= 2_000 && probes[2] - probes[1] >= 4_000,
        "{probes:?}"
    );
    assert!(s.table().entries[0].1.degraded_probes >= 3);
    // The next probe answers fast: the interval is back to 1 s.
    let mut fast_at = None;
    while now < 60_000 {
        let d = pick_at(&s, Some(key(n)), &ex, now).unwrap();
        n += 1;
        if d.reason == Reason::DegradedProbe {
            finish_streamed(&s, d.ticket, 100, None, now + 100);
            fast_at = Some(now);
            break;
        }
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
        now += 50;
    }
    let fast_at = fast_at.expect("a probe came");
    assert_eq!(s.table().entries[0].1.degraded_probes, 0);
    let next = (fast_at + 50..fast_at + 10_000)
        .step_by(50)
        .find(|&t| {
            let d = pick_at(&s, Some(key(n)), &ex, t).unwrap();
            n += 1;
            let probe = d.reason == Reason::DegradedProbe;
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, t);
            probe
        })
        .expect("another probe");
    // (A probe also waits for a new session whose rendezvous order puts the slow endpoint, at
    // a fraction of its weight, before the others: probes come later than due.) Without the
    // reset the next would be due 16 s after the last.
    assert!(
        next - fast_at < 8_000,
        "probe {} ms after the fast one",
        next - fast_at
    );
    // The cap: never more than degraded_probe_max_interval_ms apart.
    let mut st = s.table().entries[0].1;
    st.degraded_probes = 200;
    assert_eq!(placement::probe_interval(&c, st.degraded_probes), 60_000);
    assert_eq!(placement::probe_interval(&c, 0), 1_000);
}

fn body_pick<'a>(session: Option<u64>, ex: &'a Exclusions, body_bytes: usize) -> Pick<'a> {
    Pick {
        model: Some("m"),
        session,
        attempt: 1,
        exclusions: ex,
        nonce: 0,
        body_bytes,
        pin_hint: None,
        holder: None,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    }
}

/// Endpoint `i`'s successful answer at `now_ms` stated `hint` (an attempt picked, then aimed
/// at `i`).
fn answered(s: &Scheduler<'_>, i: usize, hint: &QuotaHint, now_ms: u64) {
    let ex = Exclusions::default();
    let d = s.pick(&body_pick(None, &ex, 0), now_ms).unwrap();
    let t = Ticket {
        endpoint: i,
        endpoint_id: s.cfg.endpoints[i].id,
        ..d.ticket
    };
    s.finish_observed(t, &Outcome::Success, Some(10), None, hint, now_ms);
}

fn stated(requests: Option<u64>, tokens: Option<u64>) -> QuotaHint {
    use crate::scheduler::routing::quota::Stated;
    let st = |left| Stated {
        left,
        reset_in_ms: Some(10_000),
        limit: None,
    };
    QuotaHint {
        requests: requests.map(st),
        tokens: tokens.map(st),
        at_ms: None,
    }
}

/// The session that goes to endpoint `home` first, among `0..`.
fn session_homed_at(s: &Scheduler<'_>, home: usize) -> u64 {
    let ex = Exclusions::default();
    (0..1_000u64)
        .find(|&k| {
            let d = s.pick(&body_pick(Some(k), &ex, 0), 0).unwrap();
            let at = d.endpoint;
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
            at == home
        })
        .unwrap()
}

#[test]
fn a_key_short_of_quota_loses_new_sessions_to_the_next_in_order_until_its_reset() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = session_homed_at(&s, 0);
    // a's answer says 1 000 tokens are left (reset in 10 s): a 4 000-byte (1 000-token)
    // request still fits, a 4 004-byte one does not.
    answered(&s, 0, &stated(None, Some(1_000)), 0);
    assert_eq!(
        s.pick(&body_pick(Some(k), &ex, 4_004), 1).unwrap().endpoint,
        1
    );
    let fits = s.pick(&body_pick(Some(k), &ex, 4_000), 2).unwrap();
    assert_eq!((fits.endpoint, fits.reason), (0, Reason::Home));
    // That pick took its 1 000 tokens: the next session homed at a goes to b, even a tiny one.
    let next = s.pick(&body_pick(Some(k), &ex, 4), 3).unwrap();
    assert_eq!(
        (next.endpoint, next.reason, next.affinity),
        (1, Reason::Backup, AffinityResult::Backup)
    );
    // After the reset a is a home again.
    assert_eq!(
        s.pick(&body_pick(Some(k), &ex, 4), 10_000)
            .unwrap()
            .endpoint,
        0
    );
    // With the feature off nothing is skipped, whatever the stored state.
    let off = cfg(json!({"quota_aware": false,
        "endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let s_off = Scheduler::new(&off, &store);
    assert_eq!(
        s_off
            .pick(&body_pick(Some(k), &ex, 4_004), 5)
            .unwrap()
            .endpoint,
        0
    );
}

#[test]
fn a_pinned_session_stays_until_a_429_is_certain() {
    let c = cfg(json!({"tuning": {"quota_min_tokens": 5_000},
        "endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = session_homed_at(&s, 0);
    let d = s.pick(&body_pick(Some(k), &ex, 400), 0).unwrap();
    assert_eq!(d.endpoint, 0);
    // Below the 5 000-token floor (new sessions go elsewhere), but a request left.
    s.finish_observed(
        d.ticket,
        &Outcome::Success,
        Some(10),
        Some(k),
        &stated(Some(1), Some(3_000)),
        1,
    );
    let stay = s.pick(&body_pick(Some(k), &ex, 400), 2).unwrap();
    assert_eq!((stay.endpoint, stay.affinity), (0, AffinityResult::Hit));
    assert_eq!(
        s.pick(&body_pick(Some(k + 1), &ex, 400), 2)
            .map(|d| d.endpoint == 0 && d.affinity != AffinityResult::Hit),
        Ok(false)
    );
    // That request was taken by `stay`: the next turn would be a 429 for sure, so it moves.
    let moved = s.pick(&body_pick(Some(k), &ex, 400), 3).unwrap();
    assert_eq!((moved.endpoint, moved.affinity), (1, AffinityResult::Miss));
    // In the next window (the first reset at ≈ 10 000), a request too big for the tokens left
    // moves too, with requests to spare.
    s.finish_observed(
        stay.ticket,
        &Outcome::Success,
        Some(10),
        Some(k),
        &stated(Some(50), Some(3_000)),
        10_001,
    );
    assert_eq!(
        s.pick(&body_pick(Some(k), &ex, 400), 10_002)
            .unwrap()
            .affinity,
        AffinityResult::Hit
    );
    assert_eq!(
        s.pick(&body_pick(Some(k), &ex, 12_004), 10_003)
            .unwrap()
            .endpoint,
        1
    );
}

/// Hosted APIs charge a request's output limit to the key's tokens when they admit it: a
/// pinned turn whose prompt fits what is left but whose prompt plus `max_tokens` does not would
/// be a 429 (and the key cooled for every session pinned there), so it moves; without a limit,
/// or with one that fits, it stays. The answer's `usage` then replaces the estimate.
#[test]
fn a_turns_output_limit_counts_against_the_keys_tokens() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = session_homed_at(&s, 0);
    let d = s.pick(&body_pick(Some(k), &ex, 400), 0).unwrap();
    assert_eq!(d.endpoint, 0);
    s.finish_observed(
        d.ticket,
        &Outcome::Success,
        Some(10),
        Some(k),
        &stated(None, Some(1_000)),
        1,
    );
    // 1 000 tokens left; a 2 000-byte prompt is 500 of them (4 bytes per token).
    let with_limit = |max_output_tokens| Pick {
        max_output_tokens,
        ..body_pick(Some(k), &ex, 2_000)
    };
    let over = s.pick(&with_limit(600), 2).unwrap();
    assert_eq!((over.endpoint, over.affinity), (1, AffinityResult::Miss));
    assert_eq!(
        over.ticket.quota_tokens, 1_100,
        "500 for the prompt, 600 for the output"
    );
    let fits = s.pick(&with_limit(400), 3).unwrap();
    assert_eq!((fits.endpoint, fits.affinity), (0, AffinityResult::Hit));
    assert_eq!(fits.ticket.quota_tokens, 900);
}

#[test]
fn a_later_turn_without_a_pin_here_keeps_to_its_home_until_a_429_is_certain() {
    // Another replica served this conversation's earlier turns: no pin here, but the body
    // carries them (`follow_up`). Like a pin it stays on a key short of the reserve, and moves
    // only when a 429 is certain; a first turn with the same key is placed elsewhere.
    let c = cfg(json!({"tuning": {"quota_min_tokens": 5_000},
        "endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = session_homed_at(&Scheduler::new(&c, &MemStore::new()), 0);
    // a stated 1 request and 3 000 tokens left: below the 5 000-token reserve.
    answered(&s, 0, &stated(Some(1), Some(3_000)), 0);
    let later = |now| {
        s.pick(
            &Pick {
                follow_up: true,
                ..body_pick(Some(k), &ex, 400)
            },
            now,
        )
        .unwrap()
    };
    let first = s.pick(&body_pick(Some(k), &ex, 400), 1).unwrap();
    assert_eq!(first.endpoint, 1, "a first turn is kept off the reserve");
    let stay = later(2);
    assert_eq!((stay.endpoint, stay.reason), (0, Reason::Home));
    // `stay` took a's last request: the next would be a certain 429, so it moves.
    let moved = later(3);
    assert_eq!(moved.endpoint, 1);
    assert_eq!(moved.quota_skipped, vec![0]);
}

/// quota bench, three replicas: a replica's count missed what the others spent, a
/// 2 000-token turn got a 429 that said 1 500 tokens were left, and the key was cooled whole
/// on that replica: a pinned turn of 1 000 tokens moved although it fitted, and after the
/// reset the breaker's three probes held the key for the length of their generations while
/// the other pinned turns moved. The 429's statement explains it: the count, not the breaker,
/// keeps off what does not fit.
#[test]
fn a_429_its_quota_statement_explains_keeps_the_key_for_the_turns_that_fit() {
    use crate::scheduler::routing::quota::Stated;
    let c = cfg(
        json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}],
        "half_open_probes": 3}),
    );
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let tokens = |left: u64, reset_in_ms: u64, at_ms: u64| QuotaHint {
        requests: None,
        tokens: Some(Stated {
            left,
            reset_in_ms: Some(reset_in_ms),
            limit: Some(60_000),
        }),
        at_ms: Some(at_ms),
    };
    let k = session_homed_at(&s, 0);
    let d = s.pick(&body_pick(Some(k), &ex, 400), 0).unwrap();
    assert_eq!(d.endpoint, 0);
    s.finish_observed(
        d.ticket,
        &Outcome::Success,
        Some(10),
        Some(k),
        &tokens(30_000, 4_000, 0),
        1,
    );
    // A 2 000-token turn (8 000 bytes) is refused: 1 500 left, the window resets at 4 000.
    let big = s.pick(&body_pick(Some(k), &ex, 8_000), 100).unwrap();
    assert_eq!((big.endpoint, big.affinity), (0, AffinityResult::Hit));
    let refused = Outcome::RateLimited {
        retry_after_ms: Some(3_900),
    };
    s.finish_observed(
        big.ticket,
        &refused,
        Some(10),
        Some(k),
        &tokens(1_500, 3_900, 100),
        110,
    );
    assert_eq!(s.table().entries[0].1.breaker.state, BreakerState::Closed);
    // A 1 000-token turn stays; another 2 000-token one moves (a certain 429).
    let fits = s.pick(&body_pick(Some(k), &ex, 4_000), 120).unwrap();
    assert_eq!((fits.endpoint, fits.affinity), (0, AffinityResult::Hit));
    let over = s.pick(&body_pick(Some(k), &ex, 8_000), 130).unwrap();
    assert_eq!((over.endpoint, over.affinity), (1, AffinityResult::Miss));
    // After the reset every turn goes there as before, not three probes and then elsewhere.
    for now in 4_001..4_006 {
        let d = s.pick(&body_pick(Some(k), &ex, 4_000), now).unwrap();
        assert_eq!((d.endpoint, d.reason), (0, Reason::AffinityHit), "{now}");
    }
    // A 429 whose statement does not explain it (enough left for the request) opens the
    // breaker as before.
    let d = s.pick(&body_pick(Some(k), &ex, 400), 4_010).unwrap();
    assert_eq!(d.endpoint, 0);
    s.finish_observed(
        d.ticket,
        &refused,
        Some(10),
        Some(k),
        &tokens(20_000, 3_900, 4_010),
        4_020,
    );
    assert_eq!(s.table().entries[0].1.breaker.state, BreakerState::Open);
}

#[test]
fn when_every_key_is_short_the_home_is_still_tried() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    for i in 0..2 {
        answered(&s, i, &stated(Some(0), None), 0);
    }
    let k = session_homed_at(&Scheduler::new(&c, &MemStore::new()), 1);
    // The upstream's own answer (a 429 and its reset) beats a guess.
    assert_eq!(s.pick(&body_pick(Some(k), &ex, 40), 1).unwrap().endpoint, 1);
}

#[test]
fn quota_is_remembered_only_from_successes() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let d = s.pick(&body_pick(None, &ex, 0), 0).unwrap();
    s.finish_observed(
        d.ticket,
        &Outcome::ClientError,
        Some(10),
        None,
        &stated(Some(0), None),
        0,
    );
    assert_eq!(s.table().entries[0].1.quota, Default::default());
    let d = s.pick(&body_pick(None, &ex, 0), 0).unwrap();
    s.finish_observed(
        d.ticket,
        &Outcome::Success,
        Some(10),
        None,
        &stated(Some(9), None),
        0,
    );
    assert_eq!(s.table().entries[0].1.quota.requests_left(0), Some(9));
    // Each pick takes one.
    let d = s.pick(&body_pick(None, &ex, 0), 0).unwrap();
    assert_eq!(s.table().entries[0].1.quota.requests_left(0), Some(8));
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
}

/// `Decision::quota_skipped` names exactly the endpoints passed over for quota: a placement that
/// skipped a short key, a pin left for a certain 429; not a key that fits, not the chosen one,
/// nothing with the feature off.
#[test]
fn quota_skips_name_the_endpoints_passed_over_for_quota() {
    let two = |extra: serde_json::Value| {
        let mut v = json!({"endpoints":[{"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"}]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        cfg(v)
    };
    let c = two(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let k = session_homed_at(&s, 0);
    let d = s.pick(&body_pick(None, &ex, 0), 0).unwrap();
    assert!(d.quota_skipped.is_empty(), "{:?}", d.quota_skipped);
    let t = Ticket {
        endpoint: 0,
        endpoint_id: c.endpoints[0].id,
        ..d.ticket
    };
    s.finish_observed(
        t,
        &Outcome::Success,
        Some(10),
        None,
        &stated(None, Some(1_000)),
        0,
    );
    // 1 001 tokens do not fit into a's 1 000: skipped for quota, placed on b.
    let skipped = s.pick(&body_pick(Some(k), &ex, 4_004), 1).unwrap();
    assert_eq!((skipped.endpoint, skipped.quota_skipped), (1, vec![0]));
    // 1 000 fit: nothing skipped.
    let fits = s.pick(&body_pick(Some(k), &ex, 4_000), 2).unwrap();
    assert_eq!((fits.endpoint, fits.quota_skipped), (0, vec![]));
    // Off: nothing is skipped, nothing reported.
    let off = two(json!({"quota_aware": false}));
    let d = Scheduler::new(&off, &store)
        .pick(&body_pick(Some(k), &ex, 4_004), 3)
        .unwrap();
    assert_eq!((d.endpoint, d.quota_skipped), (0, vec![]));

    // A pinned session leaves its key only for a certain 429, and that key is reported.
    let c = two(json!({"tuning": {"quota_min_tokens": 5_000}}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let k = session_homed_at(&s, 0);
    let d = s.pick(&body_pick(Some(k), &ex, 400), 0).unwrap();
    s.finish_observed(
        d.ticket,
        &Outcome::Success,
        Some(10),
        Some(k),
        &stated(Some(1), Some(3_000)),
        1,
    );
    // Below the floor but a request left: the pin holds, nothing skipped.
    let stay = s.pick(&body_pick(Some(k), &ex, 400), 2).unwrap();
    assert_eq!(
        (stay.affinity, stay.quota_skipped),
        (AffinityResult::Hit, vec![])
    );
    let moved = s.pick(&body_pick(Some(k), &ex, 400), 3).unwrap();
    assert_eq!(
        (moved.endpoint, moved.affinity, moved.quota_skipped),
        (1, AffinityResult::Miss, vec![0])
    );

    // Every key spent: the one tried after all is not reported as skipped.
    let c = two(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    for i in 0..2 {
        answered(&s, i, &stated(Some(0), None), 0);
    }
    let d = s.pick(&body_pick(Some(k), &ex, 40), 1).unwrap();
    assert!(
        !d.quota_skipped.contains(&d.endpoint) && d.quota_skipped.len() == 1,
        "{d:?}"
    );
}

// --- degraded (slow for the work) vs saturated (full by the engine's own load) ------

/// Writes endpoint `name`'s scraped record: `waiting` queued, `running` in the batch.
fn scraped(store: &dyn Store, cfg: &Config, name: &str, waiting: u32, running: u32, now: u64) {
    let load = crate::scheduler::wire::engine_load::EngineLoad {
        engine: crate::scheduler::wire::engine_load::Engine::Vllm,
        waiting: Some(waiting),
        running: Some(running),
        kv_usage_permille: Some(300),
        prompt_tokens_total: None,
        prompt_tokens_cached_total: None,
        decode: None,
    };
    // The scheduler reads the scraper's slots: the endpoint's place among the configuration's.
    let keep = crate::scheduler::routing::table::slot_ids(cfg);
    crate::scheduler::routing::scrape::fold(
        store,
        crate::scheduler::state::hash::endpoint_id(name),
        now,
        Ok(load),
        &keep,
    )
    .unwrap();
}

/// A first attempt with a body of `body_bytes` (the prompt a pinned endpoint has cached).
fn pick_body(s: &Scheduler<'_>, session: u64, body_bytes: usize, now: u64) -> Decision {
    s.pick(
        &Pick {
            model: Some("m"),
            session: Some(session),
            attempt: 1,
            exclusions: &Exclusions::default(),
            nonce: 0,
            body_bytes,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up: false,
            max_output_tokens: 0,
        },
        now,
    )
    .unwrap()
}

#[test]
fn a_saturated_endpoint_gets_no_new_sessions_but_keeps_pins_while_the_wait_is_short() {
    with_pins_on_first(json!({}), |s, ex, on_a| {
        // a's engine queues 6 (enter at 5), 64 running: full, but its queue drains fast.
        scraped(s.store, s.cfg, "a", 6, 64, 1_000);
        for n in 7_000..7_300u64 {
            let d = pick_at(s, Some(key(n)), ex, 1_100).unwrap();
            assert_ne!(d.endpoint, 0, "a new session went to a saturated endpoint");
            assert!(
                matches!(d.reason, Reason::Home | Reason::Saturated),
                "{:?}",
                d.reason
            );
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
        }
        assert_eq!(s.table().entries[0].1.saturation, Saturation::Saturated);
        // Sessions with a long cached prompt (40 000 bytes: 10 000 tokens) stay pinned.
        for &k in &on_a[..10] {
            let d = pick_body(s, k, 40_000, 1_200);
            assert_eq!((d.endpoint, d.reason), (0, Reason::AffinityHit));
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_200);
        }
        // Hysteresis: a queue of 3 keeps it saturated; 1 lets it have room again.
        scraped(s.store, s.cfg, "a", 3, 64, 2_000);
        let d = pick_at(s, Some(key(7_001)), ex, 2_000).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2_000);
        assert_eq!(s.table().entries[0].1.saturation, Saturation::Saturated);
        scraped(s.store, s.cfg, "a", 1, 64, 3_000);
        let homed_on_a = |now: u64| {
            (7_000..7_300u64)
                .filter(|&n| {
                    let d = pick_at(s, Some(key(n)), ex, now).unwrap();
                    let on_a = d.endpoint == 0;
                    s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
                    on_a
                })
                .count()
        };
        // No longer saturated, its 64 slots (the running count it showed with a queue) all
        // taken and one waiting: full by that scrape alone, which is no verdict replicas
        // share (see `capacity::HERD_MIN_SENT`); this process's own placements since the
        // scrape bound a burst: two go there, then no free slot counting them.
        assert_eq!(homed_on_a(3_000), 2);
        assert_eq!(s.table().entries[0].1.saturation, Saturation::Room);
        // 40 running, no queue: 24 free slots. The placements sent since that scrape count:
        // the first 24 sessions whose home is a go there, the others pass it (of 300, about
        // 100 have their home on a).
        scraped(s.store, s.cfg, "a", 0, 40, 4_000);
        assert_eq!(homed_on_a(4_000), 24);
        // The next scrape shows them (or not): the count starts again.
        scraped(s.store, s.cfg, "a", 0, 40, 5_000);
        assert_eq!(homed_on_a(5_000), 24);
    });
}

#[test]
fn every_endpoint_saturated_places_as_without_metrics() {
    with_pins_on_first(json!({}), |s, ex, _| {
        for name in ["a", "b", "c"] {
            scraped(s.store, s.cfg, name, 9, 8, 1_000);
        }
        let on_a = (7_000..7_300u64)
            .filter(|&n| {
                let d = pick_at(s, Some(key(n)), ex, 1_100).unwrap();
                assert_eq!(d.reason, Reason::Home);
                let a = d.endpoint == 0;
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
                a
            })
            .count();
        assert!(on_a > 50, "{on_a}");
    });
}

/// A later turn reaching a replica that holds no pin for it goes where its first turn went on
/// another replica: home while the home has room; past a home full by its engine's scrape
/// (which every replica reads alike) as a new session is. Two replicas with different own
/// traffic (r1 placed and pinned the first turns, r2 only placed sessions of its own) compute
/// the same endpoint for every such turn.
#[test]
fn a_follow_up_without_a_pin_here_goes_where_its_first_turn_went() {
    let c = three_warm(json!({}));
    let (s1, s2) = (MemStore::new(), MemStore::new());
    let (r1, r2) = (Scheduler::new(&c, &s1), Scheduler::new(&c, &s2));
    let ex = Exclusions::default();
    // Sessions whose home is a, as every replica computes it.
    let on_a: Vec<u64> = (0..600u64)
        .map(key)
        .filter(|&k| {
            let d = pick_body(&r2, k, 400, 1_000);
            r2.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_000);
            d.endpoint == 0
        })
        .take(20)
        .collect();
    assert_eq!(on_a.len(), 20);
    let turn = |r: &Scheduler<'_>, k: u64, follow_up: bool, now: u64| {
        let p = Pick {
            model: Some("m"),
            session: Some(k),
            attempt: 1,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 400,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up,
            max_output_tokens: 0,
        };
        r.pick(&p, now).unwrap()
    };
    // Both replicas read the same scrape: a is full (saturated), b and c have room.
    for store in [&s1, &s2] {
        scraped(store, r1.cfg, "a", 500, 64, 1_000);
        scraped(store, r1.cfg, "b", 0, 2, 1_000);
        scraped(store, r1.cfg, "c", 0, 2, 1_000);
    }
    // r2's own traffic: placements r1 never saw.
    for n in 0..30u64 {
        let d = pick_body(&r2, key(90_000 + n), 400, 1_050);
        r2.finish(
            d.ticket,
            &Outcome::Success,
            100,
            Some(key(90_000 + n)),
            1_050,
        );
    }
    for (i, &k) in on_a.iter().enumerate() {
        let now = 1_100 + i as u64;
        // The first turn on r1: past the full home, pinned where it was served.
        let first = turn(&r1, k, false, now);
        assert_ne!(first.endpoint, 0, "a first turn went to the full home");
        let at = first.endpoint;
        r1.finish(first.ticket, &Outcome::Success, 100, Some(k), now);
        // Its next turn on r2 (no pin there) and on r1 (pinned): the same endpoint.
        let on_r2 = turn(&r2, k, true, now + 1);
        assert_eq!(
            on_r2.endpoint, at,
            "session {k}: r2 sent its next turn elsewhere"
        );
        r2.finish(on_r2.ticket, &Outcome::Cancelled, 0, None, now + 1);
        let on_r1 = turn(&r1, k, true, now + 1);
        assert_eq!((on_r1.endpoint, on_r1.reason), (at, Reason::AffinityHit));
        r1.finish(on_r1.ticket, &Outcome::Cancelled, 0, None, now + 1);
    }
    // With room at a again (a later scrape: 10 of its 64 slots running), a turn without a
    // pin goes home as a pin would.
    for store in [&s1, &s2] {
        scraped(store, r1.cfg, "a", 0, 10, 3_000);
    }
    for &k in &on_a {
        let d = turn(&r2, k, true, 3_100);
        assert_eq!(d.affinity, AffinityResult::Home, "{k}");
        r2.finish(d.ticket, &Outcome::Cancelled, 0, None, 3_100);
    }
}

/// Every scraped input a later turn's endpoint depends on, read by two replicas that saw
/// different own traffic: the same endpoint. `a` has 4 slots (seen queueing); at each scrape
/// both replicas read the same loads, and r2 has just placed 30 new sessions of its own (its
/// placements since the scrape fill `a` by its own count), r1 none. A later turn without a pin
/// goes to the same endpoint on both: home while `a` is full by the scrape alone (no free
/// slot, no queue: not a verdict every replica shares turn after turn), past it once it is
/// saturated (a queue of 2 on 4 slots), still past it at a queue of 1 (hysteresis), home again
/// with an empty queue.
#[test]
fn two_replicas_with_different_own_traffic_send_a_later_turn_alike() {
    let c = three_warm(json!({}));
    let (s1, s2) = (MemStore::new(), MemStore::new());
    let (r1, r2) = (Scheduler::new(&c, &s1), Scheduler::new(&c, &s2));
    let ex = Exclusions::default();
    let turn = |r: &Scheduler<'_>, k: u64, follow_up: bool, now: u64| {
        let p = Pick {
            model: Some("m"),
            session: Some(k),
            attempt: 1,
            exclusions: &ex,
            nonce: 0,
            body_bytes: 400,
            pin_hint: None,
            holder: None,
            prefix: Prefix::NONE,
            follow_up,
            max_output_tokens: 0,
        };
        r.pick(&p, now).unwrap()
    };
    // Slots learned by both: a queueing on 4, b and c on 16.
    for (r, store) in [(&r1, &s1), (&r2, &s2)] {
        scraped(store, &c, "a", 1, 4, 500);
        scraped(store, &c, "b", 1, 16, 500);
        scraped(store, &c, "c", 1, 16, 500);
        let d = turn(r, key(99_999), false, 600);
        r.finish(d.ticket, &Outcome::Cancelled, 0, None, 600);
    }
    let caps = crate::scheduler::routing::select::capacity::read(&s1);
    assert_eq!(caps.get(c.endpoints[0].id).slots, 4);
    // Sessions whose home is a.
    let on_a: Vec<u64> = (0..600u64)
        .map(key)
        .filter(|&k| {
            // The rendezvous weights once the slots are known: weight × slots.
            let ids: Vec<(usize, u32, f64)> = (0..3)
                .map(|i| (i, c.endpoints[i].id, if i == 0 { 4.0 } else { 16.0 }))
                .collect();
            crate::scheduler::routing::placement::order(k, &ids).first() == Some(&0)
        })
        .take(20)
        .collect();
    assert_eq!(on_a.len(), 20);
    // (a's waiting, running) at each scrape, and whether a later turn homed on a goes there.
    let phases = [
        ((0, 4), true),
        ((2, 4), false),
        ((1, 4), false),
        ((0, 3), true),
    ];
    for (n, &((waiting, running), home)) in phases.iter().enumerate() {
        let at = 1_000 * (n as u64 + 1);
        for store in [&s1, &s2] {
            scraped(store, &c, "a", waiting, running, at);
            scraped(store, &c, "b", 0, 2, at);
            scraped(store, &c, "c", 0, 2, at);
        }
        // r2's own traffic since this scrape: 30 new sessions, pinned where placed.
        for m in 0..30u64 {
            let k = key(50_000 + 100 * n as u64 + m);
            let d = turn(&r2, k, false, at + 10);
            r2.finish(d.ticket, &Outcome::Success, 100, Some(k), at + 10);
        }
        let sent = crate::scheduler::routing::select::capacity::read(&s2)
            .get(c.endpoints[0].id)
            .sent;
        assert!(
            sent >= 2 || !home,
            "phase {n}: r2 sent {sent} to a since the scrape"
        );
        for (j, &k) in on_a.iter().enumerate() {
            let now = at + 20 + j as u64;
            let (d1, d2) = (turn(&r1, k, true, now), turn(&r2, k, true, now));
            assert_eq!(
                d1.endpoint, d2.endpoint,
                "phase {n}, session {k}: r1 and r2 disagree"
            );
            assert_eq!(d1.endpoint == 0, home, "phase {n}, session {k}: {d1:?}");
            r1.finish(d1.ticket, &Outcome::Cancelled, 0, None, now);
            r2.finish(d2.ticket, &Outcome::Cancelled, 0, None, now);
        }
    }
}

/// However long a saturated engine's queue, a pinned session stays (moves measured fewer
/// cached tokens for no better p99); new sessions still avoid the saturated engine.
#[test]
fn a_saturated_pin_stays() {
    with_pins_on_first(json!({}), |s, _, on_a| {
        scraped(s.store, s.cfg, "a", 500, 1, 1_000);
        for &k in &on_a[..5] {
            let d = pick_body(s, k, 400, 1_100);
            assert_eq!((d.endpoint, d.reason), (0, Reason::AffinityHit));
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
        }
        for n in 0..50u64 {
            let d = pick_body(s, key(70_000 + n), 400, 1_100);
            assert_ne!(d.endpoint, 0, "a new session went to the saturated engine");
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
        }
    });
}

/// Every engine's slots known and all of them full (no free slot, no saturation): new
/// sessions go by slot share, not by configured weight: the 4-slot b takes about 4/36 of them
/// (its rendezvous weight is its weight × its slots), the 16-slot a and c the rest, although
/// all weigh 1 (by weight with the slack of 8, each ≈ a third). What spills, spills within the
/// bound by slots.
#[test]
fn full_engines_share_new_sessions_by_slots() {
    let c = three_warm(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 10, 0);
    scraped(&store, &c, "a", 4, 16, 1_000);
    // One waiting on its 4 slots: not saturated (entered at 2 on 4 slots).
    scraped(&store, &c, "b", 1, 4, 1_000);
    scraped(&store, &c, "c", 4, 16, 1_000);
    let mut to = [0usize; 3];
    let mut spilled = 0;
    for n in 0..300u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 1_100).unwrap();
        to[d.endpoint] += 1;
        if d.reason == Reason::Spill {
            // Pinned where it spilled: its next turn finds the same full home.
            assert!(d.ticket.pin_on_success, "{d:?}");
            spilled += 1;
        }
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
    }
    assert!(to[1] < to[0] && to[1] < to[2], "{to:?}");
    assert!(to[1] <= 50, "b took {} of 300 (its slot share: 33)", to[1]);
    assert!(spilled <= 30, "{spilled} {to:?}");
    // After all 300: b's projected load (5 + its placements) is within its slot share of
    // the excess (2 × (346 + 1) × 4 / 36 + 1 ≈ 78) and so is the last placement's.
    let caps = crate::scheduler::routing::select::capacity::read(&store);
    let b = caps.get(c.endpoints[1].id);
    assert_eq!((b.slots, b.sent as usize), (4, to[1]));
    assert!(5 + to[1] <= 78, "{to:?}");
}

/// Every candidate full: a new session still passes over an endpoint whose queue is a batch
/// deep or more when another's is at most a quarter of it (in batches: waiting ÷ running),
/// and goes home as before when the queues are alike. Later turns without a pin here go where
/// the first turns went (every replica reads the same scrapes), and nothing pinned moves.
#[test]
fn every_engine_full_new_sessions_pass_over_a_far_longer_queue() {
    let c = three_warm(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 10, 0);
    // All saturated (≥ 5 waiting): a and b 2.5 batches deep, c 0.375.
    scraped(&store, &c, "a", 40, 16, 1_000);
    scraped(&store, &c, "b", 40, 16, 1_000);
    scraped(&store, &c, "c", 6, 16, 1_000);
    let mut to = [0usize; 3];
    for n in 0..200u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 1_100).unwrap();
        to[d.endpoint] += 1;
        if d.endpoint == 2 && d.home != Some(2) {
            assert_eq!(d.reason, Reason::Saturated, "{d:?}");
            assert!(d.ticket.pin_on_success, "{d:?}");
        }
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
    }
    assert_eq!(to, [0, 0, 200]);
    // A later turn without a pin here passes over the far longer queues as its first turn did
    // (on whichever replica served it).
    let mut later = [0usize; 3];
    for n in 0..60u64 {
        let p = Pick {
            follow_up: true,
            ..body_pick(Some(key(1_000 + n)), &ex, 400)
        };
        let d = s.pick(&p, 1_100).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
        later[d.endpoint] += 1;
    }
    assert_eq!(later, [0, 0, 60]);
    // Queues alike (1.25 batches against 0.375 × 4 = 1.5): every one goes home, as before.
    scraped(&store, &c, "a", 20, 16, 2_000);
    scraped(&store, &c, "b", 20, 16, 2_000);
    let mut to = [0usize; 3];
    for n in 0..200u64 {
        let d = pick_at(&s, Some(key(5_000 + n)), &ex, 2_100).unwrap();
        to[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2_100);
    }
    assert!(to.iter().all(|&n| n > 30), "{to:?}");
}

#[test]
fn degraded_and_saturated_are_distinct() {
    let c = three_warm(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    // a is 5x slower for the same work, b is full by its engine: a is degraded, not
    // saturated; b saturated, not degraded.
    warm(&s, &[500, 100, 100], 10, 0);
    scraped(&store, &c, "b", 20, 8, 0);
    let d = pick_at(&s, Some(key(1)), &ex, 10).unwrap();
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 10);
    let t = s.table();
    let (a, b) = (t.entries[0].1, t.entries[1].1);
    assert!(a.degraded && a.saturation == Saturation::Unknown, "{a:?}");
    assert!(
        !b.degraded && b.saturation == Saturation::Saturated,
        "{b:?}"
    );
    // New sessions all go to c; labels say why.
    let mut reasons = Vec::new();
    for n in 0..300u64 {
        let d = pick_at(&s, Some(key(n)), &ex, 10).unwrap();
        assert_eq!(d.endpoint, 2);
        reasons.push(d.reason);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 10);
    }
    assert!(reasons.contains(&Reason::Degraded) && reasons.contains(&Reason::Saturated));
    // b's slowness is c's (within the model's drift while it learned from the warm-up), far
    // from a's 5x: being full is not being slow.
    let slow = |i: usize| t.entries[i].1.slowness.value().unwrap();
    assert!(
        (0.8..1.25).contains(&(slow(1) / slow(2))),
        "{}",
        slow(1) / slow(2)
    );
    assert!(slow(0) / slow(2) > 4.0, "{}", slow(0) / slow(2));
}

/// Finishes a success whose answer had this shape: streamed (timed to its first byte) or
/// plain (timed to its end), `uncached` prompt tokens and `completion` tokens, taking what the
/// prior work model expects × `jitter` (50 ms + 0.2 ms per uncached token + 10 ms per
/// completion token of a plain answer).
fn finish_work(
    s: &Scheduler<'_>,
    mut t: Ticket,
    streamed: bool,
    uncached: u64,
    completion: u64,
    jitter: f64,
) {
    let decode = if streamed {
        0.0
    } else {
        10.0 * completion as f64
    };
    let ms = ((50.0 + 0.2 * uncached as f64 + decode) * jitter) as u64;
    t.served = Some(Served {
        streamed,
        decode_ms: None,
        decode_bytes: None,
        observed_ms: ms,
        usage: Some(Usage {
            prompt_tokens: uncached + 500,
            cached_tokens: 500,
            completion_tokens: completion,
        }),
        body_bytes: 0,
        relayed_bytes: 0,
        work_key: WORK.into(),
    });
    s.finish(t, &Outcome::Success, ms, None, 0);
}

#[test]
fn replicas_with_different_own_signals_compute_the_same_homes() {
    // Two replicas (two stores) see the same scraped records, but each measured its own
    // answers: on r1 endpoint a served long plain generations (raw latency ~5 s) and the
    // others short streams (~100–300 ms); on r2 it is b. The raw latency estimates differ
    // 20x between endpoints and between replicas; the work does not. r1 also carries 30
    // attempts in flight on its endpoints. Weights and verdicts ignore all of that: homes agree.
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb","weight":2},
        {"name":"c","cluster":"cc"},{"name":"d","cluster":"cd"}
    ],"cold_start_samples":5}));
    let (s1, s2) = (MemStore::new(), MemStore::new());
    let (r1, r2) = (Scheduler::new(&c, &s1), Scheduler::new(&c, &s2));
    for (r, long) in [(&r1, 0usize), (&r2, 1)] {
        seed_model(r.store);
        for j in 0..40u64 {
            for i in 0..4usize {
                let jitter = 0.8 + 0.4 * ((j * 7 + i as u64 * 3) % 10) as f64 / 10.0;
                let t = r
                    .pick(
                        &Pick {
                            model: Some("m"),
                            session: None,
                            attempt: 1,
                            exclusions: &Exclusions {
                                tried: (0..4).filter(|&x| x != i).collect(),
                                ..Exclusions::default()
                            },
                            nonce: j,
                            body_bytes: 0,
                            pin_hint: None,
                            holder: None,
                            prefix: Prefix::NONE,
                            follow_up: false,
                            max_output_tokens: 0,
                        },
                        0,
                    )
                    .unwrap()
                    .ticket;
                if i == long {
                    finish_work(r, t, false, 200 + j * 10, 300 + j * 5, jitter);
                } else {
                    finish_work(r, t, true, 100 + j * 40, 16, jitter);
                }
            }
        }
        let raw: Vec<f64> = r
            .table()
            .entries
            .iter()
            .map(|e| e.1.latency_ms.unwrap())
            .collect();
        assert!(raw[long] > 10.0 * raw[3 - long], "raw latencies {raw:?}");
        assert!(r.table().entries.iter().all(|e| !e.1.degraded));
    }
    for store in [&s1, &s2] {
        scraped(store, r1.cfg, "c", 12, 8, 0); // saturated for both
        scraped(store, r1.cfg, "d", 1, 3, 0);
    }
    // Different in-flight counts: r1 holds 30 attempts.
    let held: Vec<Decision> = (0..30u64)
        .map(|n| pick_at(&r1, Some(key(50_000 + n)), &Exclusions::default(), 5).unwrap())
        .collect();
    let mut differ = 0;
    for n in 0..2_000u64 {
        let d1 = pick_at(&r1, Some(key(n)), &Exclusions::default(), 10).unwrap();
        let d2 = pick_at(&r2, Some(key(n)), &Exclusions::default(), 10).unwrap();
        assert_ne!(d1.endpoint, 2, "saturated c got a new session");
        differ += usize::from(d1.endpoint != d2.endpoint || d1.home != d2.home);
        r1.finish(d1.ticket, &Outcome::Cancelled, 0, None, 10);
        r2.finish(d2.ticket, &Outcome::Cancelled, 0, None, 10);
    }
    assert_eq!(differ, 0);
    for d in held {
        r1.finish(d.ticket, &Outcome::Cancelled, 0, None, 10);
    }
}

// --- a Responses follow-up's holder is part of the pick -------------------

fn holder_pick<'a>(
    ex: &'a Exclusions,
    session: u64,
    holder: Option<u32>,
    pin_hint: Option<u32>,
) -> Pick<'a> {
    Pick {
        model: Some("m"),
        session: Some(session),
        attempt: 1,
        exclusions: ex,
        nonce: 0,
        body_bytes: 4000,
        pin_hint,
        holder,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    }
}

/// The holder is taken although it is degraded, a pin cookie names another endpoint, and its
/// quota says staying is a certain 429 (each of which moves an ordinary pinned session); the
/// pick fails, rather than going elsewhere, when its breaker is open or the request already
/// tried it.
#[test]
fn a_holder_is_picked_whatever_its_verdicts_quota_or_pin_cookie() {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}
    ],"cold_start_samples":5}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let (a, b) = (c.endpoints[0].id, c.endpoints[1].id);
    let k = key(7);
    warm(&s, &[500, 100, 100], 20, 0);
    // An ordinary session pinned to a: a is degraded, the pin breaks.
    s.affinity().remember(k, a, 1);
    let d = s.pick(&holder_pick(&ex, k, None, None), 2).unwrap();
    assert_eq!(d.reason, Reason::PinBreak);
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
    // The holder: taken, and a pin cookie naming b changes nothing.
    for hint in [None, Some(b)] {
        let d = s.pick(&holder_pick(&ex, k, Some(a), hint), 3).unwrap();
        assert_eq!(
            (d.endpoint, d.reason, d.affinity),
            (0, Reason::AffinityHit, AffinityResult::Hit)
        );
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 3);
    }
    // Its quota says no request is left: a certain 429 moves a pin, not the holder.
    answered(&s, 0, &stated(Some(0), None), 4);
    let d = s.pick(&holder_pick(&ex, k, None, Some(a)), 5).unwrap();
    assert_ne!(d.endpoint, 0, "an ordinary pin leaves a certain 429");
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 5);
    let d = s.pick(&holder_pick(&ex, k, Some(a), None), 5).unwrap();
    assert_eq!(d.endpoint, 0);
    // Already tried in this request: no other endpoint instead.
    let tried = Exclusions {
        tried: vec![0],
        ..Exclusions::default()
    };
    assert_eq!(
        s.pick(&holder_pick(&tried, k, Some(a), None), 6),
        Err(NoEndpoint::Exhausted)
    );
    // Rate limited for 7 s: the holder's own recovery time, not another endpoint.
    let limited = Outcome::RateLimited {
        retry_after_ms: Some(7_000),
    };
    s.finish(d.ticket, &limited, 5, None, 10);
    assert_eq!(
        s.pick(&holder_pick(&ex, k, Some(a), None), 11),
        Err(NoEndpoint::CoolingDown {
            retry_at_ms: 7_010,
            all_rate_limited: true
        })
    );
}

// --- in-flight counts expire per attempt age ------------------------------

/// An attempt whose ticket is never handed back (a VM crash between pick and finish) on an
/// endpoint that serves a request every second for 20 minutes: its count expires within 1.5 ×
/// `in_flight_max_age_ms` (600 s) of its start, although the endpoint is never quiet. Before,
/// only 10 quiet minutes expired it, and the busy endpoint carried the leaked 1 for good.
#[test]
fn a_busy_endpoints_leaked_in_flight_count_expires_by_its_age() {
    let c = cfg(json!({"endpoints":[{"name":"a","cluster":"ca"}]}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    let leaked = pick_at(&s, None, &ex, 0).unwrap();
    drop(leaked.ticket);
    let mut at_end = Vec::new();
    for sec in 1..=1_200u64 {
        let now = sec * 1_000;
        let d = pick_at(&s, None, &ex, now).unwrap();
        assert_eq!(d.endpoint, 0);
        s.finish(d.ticket, &Outcome::Success, 5, None, now + 10);
        // What the table says between requests: only the leak, if anything.
        at_end.push((now, s.table().entries[0].1.in_flight));
    }
    let leaked_until = at_end.iter().filter(|(_, n)| *n > 0).map(|(t, _)| *t).max();
    assert!(
        leaked_until.is_some_and(|t| (600_000..=900_000).contains(&t)),
        "the leaked count lasted until {leaked_until:?} ms"
    );
    assert_eq!(at_end.last().map(|(_, n)| *n), Some(0));
}

// --- The last healthy server of a model is relieved of the other models' sessions -----------

/// The bench's fleet: `a` and `b` serve `m` and `m2`, `c` and `d` only `m`; every endpoint
/// warm at 100 ms and scraped. `extra`: configuration keys on top.
fn two_models(extra: serde_json::Value) -> Config {
    let mut v = json!({"endpoints":[
        {"name":"a","cluster":"ca","models":["m","m2"]},{"name":"b","cluster":"cb","models":["m","m2"]},
        {"name":"c","cluster":"cc","models":["m"]},{"name":"d","cluster":"cd","models":["m"]}
    ],"cold_start_samples":5,"affinity_ttl_ms":60_000});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    cfg(v)
}

/// A first attempt of `session` for `model`, a later turn when `follow_up`.
fn model_pick<'a>(model: &'a str, session: u64, ex: &'a Exclusions, follow_up: bool) -> Pick<'a> {
    Pick {
        model: Some(model),
        follow_up,
        ..body_pick(Some(session), ex, 4000)
    }
}

/// Where 300 new `m` sessions go (by endpoint index) at `now`.
fn new_m_sessions(s: &Scheduler<'_>, ex: &Exclusions, from: u64, now: u64) -> [usize; 4] {
    let mut to = [0usize; 4];
    for n in from..from + 300 {
        let d = s.pick(&model_pick("m", key(n), ex, false), now).unwrap();
        to[d.endpoint] += 1;
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, now);
    }
    to
}

/// `a` degraded (5× slower for the work) leaves `b` the last server of `m2`: new `m` sessions
/// pass over `b` while `c` or `d` is lighter, and half of them (the reservation coin) when it is
/// not; never while no endpoint is degraded; `m2` sessions still go to `b`.
#[test]
fn new_sessions_pass_over_the_last_server_of_another_model() {
    {
        let c = two_models(json!({}));
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        warm(&s, &[100, 100, 100, 100], 10, 0);
        // b busier than c and d, none of them full (no queue anywhere).
        for (name, waiting, running) in [("a", 0, 2), ("b", 0, 14), ("c", 0, 6), ("d", 0, 6)] {
            scraped(&store, &c, name, waiting, running, 1_000);
        }
        // Healthy fleet: b takes its rendezvous share whatever the switch.
        let healthy = new_m_sessions(&s, &ex, 0, 1_100);
        assert!(healthy[1] > 40, "{healthy:?}");
        // a turns 5× slower: degraded.
        warm(&s, &[500, 100, 100, 100], 20, 1_200);
        let slow = new_m_sessions(&s, &ex, 1_000, 1_300);
        assert!(s.table().entries[0].1.degraded);
        assert_eq!(slow[0], 0, "{slow:?}");
        assert_eq!(slow[1], 0, "{slow:?}");
        // m2 sessions have nowhere else to go.
        for n in 0..50u64 {
            let d = s
                .pick(&model_pick("m2", key(5_000 + n), &ex, false), 1_300)
                .unwrap();
            assert_eq!(d.endpoint, 1, "{d:?}");
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_300);
        }
        // b no busier than the others: it takes new m sessions again, but for the half kept
        // for m2 (the reservation coin).
        for (name, waiting, running) in [("b", 0, 6), ("c", 0, 6), ("d", 0, 6)] {
            scraped(&store, &c, name, waiting, running, 1_400);
        }
        let even = new_m_sessions(&s, &ex, 2_000, 1_500);
        assert!((25..=75).contains(&even[1]), "{even:?}");
    }
}

/// With `a` degraded and `b` the last server of `m2` a batch deep in queue while `c` and `d`
/// have a quarter of that: `m` sessions pinned to `b` move (reason `saturated`, once: the next
/// turn is an affinity hit where they went), later turns without a pin here whose home is `b`
/// too; `m2` sessions stay; nothing moves without a degraded endpoint, or when the queues are
/// alike.
#[test]
fn pinned_sessions_move_off_the_last_server_of_another_model_once() {
    {
        let c = two_models(json!({}));
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        warm(&s, &[100, 100, 100, 100], 10, 0);
        // Sessions of both models pinned to b.
        let mut on_b = Vec::new();
        for (model, from) in [("m", 0u64), ("m2", 10_000)] {
            for n in from..from + 300 {
                let d = s.pick(&model_pick(model, key(n), &ex, false), 1).unwrap();
                if d.endpoint == 1 {
                    on_b.push((model, key(n)));
                }
                s.finish(d.ticket, &Outcome::Success, 100, Some(key(n)), 1);
            }
        }
        let count = |model: &str| on_b.iter().filter(|(m, _)| *m == model).count();
        let (m, m2) = (count("m"), count("m2"));
        assert!(m > 20 && m2 > 20, "{m} {m2}");
        // b 1.25 batches deep, c and d 0.25.
        for (name, waiting, running) in [("a", 0, 4), ("b", 20, 16), ("c", 4, 16), ("d", 4, 16)] {
            scraped(&store, &c, name, waiting, running, 1_000);
        }
        // No endpoint degraded: every pin holds.
        for &(model, k) in &on_b[..10] {
            let d = s.pick(&model_pick(model, k, &ex, true), 1_100).unwrap();
            assert_eq!((d.endpoint, d.reason), (1, Reason::AffinityHit), "{d:?}");
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_100);
        }
        warm(&s, &[500, 100, 100, 100], 20, 1_200);
        for &(model, k) in &on_b {
            let d = s.pick(&model_pick(model, k, &ex, true), 1_300).unwrap();
            if model == "m" {
                assert!(d.endpoint == 2 || d.endpoint == 3, "{d:?}");
                assert_eq!(
                    (d.reason, d.moved_pin_of),
                    (Reason::Saturated, Some(1)),
                    "{d:?}"
                );
                s.finish(d.ticket, &Outcome::Success, 100, Some(k), 1_300);
                let again = s.pick(&model_pick(model, k, &ex, true), 1_400).unwrap();
                assert_eq!(again.reason, Reason::AffinityHit, "{again:?}");
                assert_eq!(again.endpoint, d.endpoint);
                s.finish(again.ticket, &Outcome::Cancelled, 0, None, 1_400);
            } else {
                assert_eq!((d.endpoint, d.reason), (1, Reason::AffinityHit), "{d:?}");
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_300);
            }
        }
        assert!(s.table().entries[0].1.degraded);
        // Later turns without a pin here whose home is b (a skipped, degraded): they move too.
        let all: Vec<(usize, u32, f64)> = (0..4).map(|i| (i, c.endpoints[i].id, 1.0)).collect();
        let homed: Vec<u64> = (20_000..21_000u64)
            .map(key)
            .filter(|&k| placement::order(k, &all).into_iter().find(|&i| i != 0) == Some(1))
            .take(20)
            .collect();
        assert_eq!(homed.len(), 20);
        for &k in &homed[..10] {
            let d = s.pick(&model_pick("m", k, &ex, true), 1_500).unwrap();
            assert!(d.endpoint == 2 || d.endpoint == 3, "{d:?}");
            assert_eq!(
                (d.reason, d.moved_pin_of),
                (Reason::Saturated, Some(1)),
                "{d:?}"
            );
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_500);
        }
        // Queues alike (c and d as deep as b): they go home.
        for (name, waiting, running) in [("b", 20, 16), ("c", 20, 16), ("d", 20, 16)] {
            scraped(&store, &c, name, waiting, running, 1_600);
        }
        for &k in &homed[10..] {
            let d = s.pick(&model_pick("m", k, &ex, true), 1_700).unwrap();
            assert_eq!((d.endpoint, d.moved_pin_of), (1, None), "{d:?}");
            s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_700);
        }
    }
}

/// Once the keys have stated their limits, new sessions go to them in
/// proportion (a key with an eighth of its peers' limit gets about 1/17 of the new sessions,
/// not a third). quota bench: placed evenly in a long first window, before their
/// use said anything, the small keys took a quarter of the new sessions each and ran dry in
/// the next window, and their pinned sessions moved. Pinned sessions stay where they are.
#[test]
fn new_sessions_follow_the_keys_stated_limits() {
    let eps = three_keys();
    let share_of_c = |extra: serde_json::Value| {
        let mut v = json!({ "endpoints": eps.clone() });
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        let c = cfg(v);
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        let k = session_homed_at(&s, 2);
        let pinned = s.pick(&body_pick(Some(k), &ex, 40), 0).unwrap();
        assert_eq!(pinned.endpoint, 2);
        s.finish(pinned.ticket, &Outcome::Success, 10, Some(k), 1);
        state_limits(&s, 1);
        let on_c = (10_000..10_600u64)
            .filter(|&k| {
                let d = s.pick(&body_pick(Some(k), &ex, 4), 2).unwrap();
                let at = d.endpoint;
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
                at == 2
            })
            .count();
        // The session pinned to c before stays there.
        let stay = s.pick(&body_pick(Some(k), &ex, 40), 3).unwrap();
        assert_eq!((stay.endpoint, stay.affinity), (2, AffinityResult::Hit));
        on_c
    };
    let on = share_of_c(json!({}));
    // Without quota-aware routing the limits are not read: placed by the plain weights.
    let off = share_of_c(json!({"quota_aware": false}));
    // 1/17 of 600 is 35; a third is 200.
    assert!((15..60).contains(&on), "{on}");
    assert!((160..240).contains(&off), "{off}");
}

/// When every candidate is short of quota, a new session goes to the key with the most tokens
/// left after its forecast use, not to the first of its order (about 1 in 17 would go to `c`,
/// which weighs 1/8 of `a` and `b`). In
/// quota bench the big keys were short by the reserve (half their limit kept for
/// their pinned sessions, with about 180 000 tokens still free) while a small key had a few
/// thousand: the first of the order put sessions on the small key, which then ran dry in the
/// next window. Pinned sessions stay where they are.
#[test]
fn when_every_key_is_short_a_new_session_goes_to_the_roomiest() {
    use crate::scheduler::routing::quota::Stated;
    let on_c = || {
        let c = cfg(json!({
            "endpoints": three_keys(),
            "tuning": {"quota_reserve_percent": 50},
        }));
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        let k = session_homed_at(&s, 2);
        let pinned = s.pick(&body_pick(Some(k), &ex, 40), 0).unwrap();
        s.finish(pinned.ticket, &Outcome::Success, 10, Some(k), 1);
        // a and b used 220 000 of 400 000 (over their pace for the reserve: short, with
        // 180 000 free), c 28 000 of 50 000 (short, 22 000 free).
        for (i, limit, used) in [
            (0, 400_000, 220_000),
            (1, 400_000, 220_000),
            (2, 50_000, 28_000),
        ] {
            let hint = QuotaHint {
                requests: None,
                tokens: Some(Stated {
                    left: limit - used,
                    reset_in_ms: Some(6_000),
                    limit: Some(limit),
                }),
                at_ms: None,
            };
            answered(&s, i, &hint, 2);
        }
        let placed = (10_000..10_300u64)
            .filter(|&k| {
                let d = s.pick(&body_pick(Some(k), &ex, 4), 3).unwrap();
                let at = d.endpoint;
                s.finish(d.ticket, &Outcome::Cancelled, 0, None, 3);
                at == 2
            })
            .count();
        // The session pinned to c stays there (c has its turn's tokens).
        let stay = s.pick(&body_pick(Some(k), &ex, 40), 4).unwrap();
        assert_eq!((stay.endpoint, stay.affinity), (2, AffinityResult::Hit));
        placed
    };
    assert_eq!(on_c(), 0);
}

/// A new session that spilled (over its bounded load) from a home kept off for its quota is
/// pinned where it was served: its next turn without a pin would go
/// home as a pin would (a home is passed over only for a certain 429), re-prefilling on a key
/// that still had quota (quota bench, `quota7-3` ×3: 2 such moves).
#[test]
fn a_spill_from_a_home_short_of_quota_pins() {
    use crate::scheduler::routing::quota::Stated;
    let pinned_spill = || {
        let c = cfg(json!({
            "endpoints": [{"name":"x","cluster":"cx"},{"name":"y","cluster":"cy"}],
            "tuning": {
                "quota_reserve_percent": 50,
                "bounded_load_epsilon": 0.25,
                "bounded_load_slack": 1,
            },
        }));
        let store = MemStore::new();
        let s = Scheduler::new(&c, &store);
        let ex = Exclusions::default();
        // x used 60 000 of 100 000 (over the reserve: short for new sessions, not for a pin).
        let hint = QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: 40_000,
                reset_in_ms: Some(60_000),
                limit: Some(100_000),
            }),
            at_ms: None,
        };
        answered(&s, 0, &hint, 1);
        // y busy: new sessions kept in flight there until it is over its bounded load.
        let mut held = Vec::new();
        let mut spilled = None;
        for n in 0..40u64 {
            let d = s.pick(&body_pick(Some(key(n)), &ex, 4), 2).unwrap();
            assert_eq!(d.endpoint, 1, "{d:?}");
            if d.reason == Reason::Spill && d.home == Some(0) && spilled.is_none() {
                spilled = Some((key(n), d.ticket.pin_on_success));
            }
            held.push((key(n), d));
        }
        let (k, pins) = spilled.expect("a session homed at x spilled to y");
        for (n, d) in held {
            s.finish(d.ticket, &Outcome::Success, 10, Some(n), 3);
        }
        // Its next turn: where the pin says, else home.
        let mut next = body_pick(Some(k), &ex, 40);
        next.follow_up = true;
        let d = s.pick(&next, 4).unwrap();
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 4);
        (pins, d.endpoint)
    };
    // Pinned: the next turn stays on y instead of moving home to x, which had quota for it.
    assert_eq!(pinned_spill(), (true, 1));
}

fn three_keys() -> serde_json::Value {
    json!([
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"c","cluster":"cc"}
    ])
}

/// Answers of keys a, b and c stating token limits of 400 000, 400 000 and 50 000 (full).
fn state_limits(s: &Scheduler<'_>, now_ms: u64) {
    use crate::scheduler::routing::quota::Stated;
    for (i, limit) in [(0, 400_000), (1, 400_000), (2, 50_000)] {
        let hint = QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: limit,
                reset_in_ms: Some(60_000),
                limit: Some(limit),
            }),
            at_ms: None,
        };
        answered(s, i, &hint, now_ms);
    }
}

/// The limit weights order a new placement's walk, not the session's home: every replica
/// computes the home from the plain weights, heard from the keys or not. A session placed
/// away from it is labelled so (its answer sets the pin cookie), and a later turn without a
/// pin goes home. Ordering homes by the limit weights, a replica that had heard from the keys
/// sent a later turn elsewhere than the replica that had not placed it (bench, three
/// replicas: sessions went back and forth between keys that both had quota).
#[test]
fn limit_weights_order_new_placements_not_homes() {
    let c = cfg(json!({ "endpoints": three_keys() }));
    let ex = Exclusions::default();
    // Sessions whose home is c, on a replica that has heard nothing.
    let plain_store = MemStore::new();
    let plain = Scheduler::new(&c, &plain_store);
    let homed_at_c: Vec<u64> = (20_000..20_300u64)
        .filter(|&k| {
            let d = plain.pick(&body_pick(Some(k), &ex, 4), 0).unwrap();
            plain.finish(d.ticket, &Outcome::Cancelled, 0, None, 0);
            d.endpoint == 2
        })
        .collect();
    assert!(homed_at_c.len() > 60, "{}", homed_at_c.len());
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    state_limits(&s, 1);
    let mut away = 0;
    for &k in &homed_at_c {
        let d = s.pick(&body_pick(Some(k), &ex, 4), 2).unwrap();
        assert_eq!(d.home, Some(2));
        away += usize::from(d.endpoint != 2);
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2);
    }
    // About 7 in 8 placed elsewhere (c weighs 1/8).
    assert!(
        away * 4 > homed_at_c.len() * 3,
        "{away} of {}",
        homed_at_c.len()
    );
    for &k in &homed_at_c {
        let mut p = body_pick(Some(k), &ex, 4);
        p.follow_up = true;
        let d = s.pick(&p, 3).unwrap();
        assert_eq!((d.endpoint, d.home), (2, Some(2)), "session {k}");
        s.finish(d.ticket, &Outcome::Cancelled, 0, None, 3);
    }
}

/// Loads turning known (every engine `Unknown` → `Room`: the first pick after a scrape round)
/// rewrite no entry but the chosen one: `Room` over a stored `Unknown` changes nothing read
/// back (the hysteresis and the gauge read only "saturated"). A saturated engine's verdict is
/// still stored, and its return to room too.
#[test]
fn loads_turning_known_rewrite_only_the_chosen_entry() {
    let c = three_warm(json!({}));
    let store = MemStore::new();
    let s = Scheduler::new(&c, &store);
    let ex = Exclusions::default();
    warm(&s, &[100, 100, 100], 10, 0);
    for name in ["a", "b", "c"] {
        scraped(&store, &c, name, 0, 2, 1_000);
    }
    let before = s.table();
    let d = pick_at(&s, Some(key(1)), &ex, 1_000).unwrap();
    let after = s.table();
    for j in (0..3).filter(|&j| j != d.endpoint) {
        assert_eq!(after.entries[j], before.entries[j], "entry {j} rewritten");
    }
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 1_000);
    // b fills: stored as saturated, and as room again once its queue is gone.
    scraped(&store, &c, "b", 20, 8, 2_000);
    let d = pick_at(&s, Some(key(2)), &ex, 2_000).unwrap();
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 2_000);
    assert_eq!(s.table().entries[1].1.saturation, Saturation::Saturated);
    scraped(&store, &c, "b", 0, 2, 3_000);
    let d = pick_at(&s, Some(key(3)), &ex, 3_000).unwrap();
    s.finish(d.ticket, &Outcome::Cancelled, 0, None, 3_000);
    assert_eq!(s.table().entries[1].1.saturation, Saturation::Room);
}

/// A request admitted from the admission queue passes over the endpoints admission found no
/// free place on (`Exclusions::placeless`) while another candidate has one, in rendezvous
/// order; all of them without a place, or a later attempt: the order as ever.
#[test]
fn an_admitted_request_passes_over_endpoints_without_a_place() {
    let c = cfg(json!({"endpoints":[
        {"name":"a","cluster":"ca"},{"name":"b","cluster":"cb"},{"name":"e","cluster":"ce"}
    ]}));
    let placeless = |v: Vec<usize>| Exclusions {
        placeless: v,
        ..Exclusions::default()
    };
    for key in 0..30u64 {
        let pick = |ex: &Exclusions, attempt: u32| {
            let store = MemStore::new();
            let s = Scheduler::new(&c, &store);
            s.pick(
                &Pick {
                    model: Some("m"),
                    session: Some(key),
                    attempt,
                    exclusions: ex,
                    nonce: 0,
                    body_bytes: 0,
                    pin_hint: None,
                    holder: None,
                    prefix: Prefix::NONE,
                    follow_up: false,
                    max_output_tokens: 0,
                },
                0,
            )
            .unwrap()
        };
        let plain = pick(&Exclusions::default(), 1);
        let home = plain.endpoint;
        assert_eq!(plain.reason, Reason::Home);
        // Home without a place: the next of the order that has one.
        let d = pick(&placeless(vec![home]), 1);
        assert_ne!(d.endpoint, home, "key {key}");
        assert_eq!(d.reason, Reason::Saturated);
        assert_eq!(d.home, Some(home));
        // Only one place, on the last of the order: there.
        let others: Vec<usize> = (0..3).filter(|&i| i != d.endpoint).collect();
        let last = (0..3).find(|i| !others.contains(i)).unwrap();
        assert_eq!(pick(&placeless(others.clone()), 1).endpoint, last);
        // Nowhere a place: home as ever; a failover's attempt ignores it.
        assert_eq!(pick(&placeless(vec![0, 1, 2]), 1).endpoint, home);
        assert_eq!(pick(&placeless(vec![home]), 2).endpoint, home);
    }
}
